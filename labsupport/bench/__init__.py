"""Benchmarks: one module per ``python -m labsupport bench <name>`` command.

Each module drives a mechanism (imported from labsupport), prints a table, writes JSON (and a plot)
under ``results/`` through ``labsupport.course.results``, and exposes ``main(argv)``. Mechanisms
never import from here.
"""
