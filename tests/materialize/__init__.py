"""Tests of gpipe.materialize, one module per module (a package: one name everywhere)."""
