import os

from hypothesis import settings

# Property tests are derandomized (the same examples on every run, no example database): the
# suite never passes or fails by the luck of a search. PLAIT_HYPOTHESIS=explore searches anew.
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True, database=None)
settings.register_profile("explore", max_examples=400, deadline=None)
settings.load_profile(os.environ.get("PLAIT_HYPOTHESIS", "ci"))

# `schedule="auto"` keeps its decisions in memory only unless a test names a cache file:
# the suite never writes to the user's cache directory.
os.environ["PLAIT_TUNING_CACHE"] = "off"
