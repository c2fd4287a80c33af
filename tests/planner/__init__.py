"""Tests of gpipe.planner, one module per module (a package: one name everywhere)."""
