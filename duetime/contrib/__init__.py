"""Integrations of duetime with other frameworks (``duetime.contrib.django``).

Unlike the rest of ``duetime``, these modules hold code of their own: each adapts a
framework's interface to duetime's public API. Each imports its framework, so import
one only where that framework is installed; ``import duetime`` imports none of them.
"""
