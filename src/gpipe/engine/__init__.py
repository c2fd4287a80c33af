"""The engine: one process's compute, running a schedule's actions on the stages it holds
(its modules, one line each: docs/architecture.md)."""
