"""Report and export test traces: the old module name, kept for the tests that import it. The builder is
tests/helpers/tracebuild.py, the one test trace builder."""

from tests.helpers.tracebuild import *  # noqa: F403 - re-exports every public name of the one builder
