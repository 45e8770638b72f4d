"""A minimal Django project whose own tests (``manage.py test``, Django's test runner)
check ``duetime.enqueue`` inside ``transaction.atomic()`` against real PostgreSQL; run
by tests/integration/test_sync_enqueue.py."""
