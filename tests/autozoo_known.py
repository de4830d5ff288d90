"""Model types of the full zoo that fail today, with the failure class and the error's first line.

Generated from a full run: ``benchmarks/full_zoo.py --from-json out/full_zoo.json --known``. The tests of
these model types are ``xfail(strict=True)``: a fix makes them pass, and the entry must then go.
"""

KNOWN: dict[str, tuple[str, str]] = {}
