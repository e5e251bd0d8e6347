"""The lab: candidate kernels (triton_decode_mma.py) and one-off studies, kept apart from the
product (kivi_ops and what `kivi` runs). Not installed; run from the repository root with
`python -m lab` (see __main__.py)."""
