"""The lab: research on campaigns, never a stage of one (`tasks/` may not import it): experiments (arms
against the base), bake-offs, parity, probes, overlay research, and one record per lab job (`jobs.py`)."""
