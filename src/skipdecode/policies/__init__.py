"""Which layers a position runs: SkipDecode's schedules and the baselines they are compared with."""
