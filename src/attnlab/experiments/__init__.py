"""Experiments: the sweep runner with its verdict rules and reports (`sweep`, `report`), the cluster
launcher (`launch`), the quickstart (`quickstart`) and seed 003's simulation (`scalings`).

The committed specs and their generated reports live in the repository's `experiments/` folder.
"""
