"""duetime scheduler core: config, schema, stores, election, the leader's duties, CLI."""

__version__ = "0.1.0"
