"""Test helpers for galva-hp: tiny deterministic models (:mod:`.models`) with parallel forms for every mode."""
