"""Publishes (`serve --nixl`): learner ranks publish a served copy they exported themselves; the
server READs it over NIXL into a version of its own, checks it, and commits it as a push commits."""
