"""Tests of hmoe.compat: the report, its JSON schema and the command line."""
