import os

from hypothesis import settings

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

# `schedule="auto"` keeps its decisions in memory only unless a test names a cache file:
# the suite never writes to the user's cache directory.
os.environ["PLAIT_TUNING_CACHE"] = "off"
