import os

from hypothesis import HealthCheck, settings

# CI machines are slow and shared: no per-example deadlines, fewer examples than a local deep run.
settings.register_profile("ci", deadline=None, max_examples=60,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", deadline=None, max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
