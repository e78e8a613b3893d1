"""The checks of a loaded checkpoint's values live in lib/boundary.py; these names stay importable here."""

from lib.boundary import (diverged, fit_problem, non_finite, plain_values, preset_problem,  # noqa: F401
                          stored_problem, weights_problem)
