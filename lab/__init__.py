"""Experiments on a campaign: arms against the base, bake-offs, parity, probes, overlay research."""
