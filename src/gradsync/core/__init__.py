"""The bottom layer: what every other part may use and that uses no other part of gradsync.
Which rank writes (ranks.py), a rank's life bound to its launcher's (lifeline.py), devices and
what they compute (devices.py), a precision's dtypes (dtypes.py), seeds (seeds.py), the
"k of N" and ETA of long work (progress.py)."""
