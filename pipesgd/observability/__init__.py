"""What a run shows and saves about itself (docs/observability.md): spans for the timeline
(trace.py), the rank-0 progress bar (progress.py), metric writers (metrics.py), the facts saved
next to its numbers (runinfo.py: code version, atomic JSON, digests; hostinfo.py: the host's
fingerprint) and what a finished run reports (summary.py). No module here imports the engines."""
