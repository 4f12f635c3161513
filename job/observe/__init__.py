"""What a run tells: progress lines, metric writers, goodput, stragglers, profiles and plots."""
