"""Task modules and helpers for worker tests (``--import tests.fixtures_tasks.basic``)."""
