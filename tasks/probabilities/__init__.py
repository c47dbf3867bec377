"""From fast-pass readouts to calibrated probabilities: coverage gate, fold, temperature scaling."""
