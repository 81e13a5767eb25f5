"""Entry-point scripts (`trl-agentic train`, ...): each is `make_parser()` + `main(...)`, runnable with `python -m`."""
