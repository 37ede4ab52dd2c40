"""The GPU check (scripts/gpu_check.sh), divided by concern; scripts/gpu_check.py is its entry point and
profiles.py the map of which pieces run in which order."""
