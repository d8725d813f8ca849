"""What a finished run left behind, read back: status, plots, comparisons, export, tuning."""
