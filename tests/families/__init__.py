"""The model-family matrix: tiny random-weight models of each family, checked against the engine.

``harness.py`` runs one family's scenarios; each ``specs_*.py`` module lists families
(``SPECS``) with their tiny config (from the dimensions in the engines' own tests) and inputs.
"""
