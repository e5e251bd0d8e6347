"""`kivi serve`'s machinery, installed as kivi_serve: the OpenAI API (app.py) in front of an
engine thread (engine.py) that schedules requests onto a static or paged cache (block_manager.py,
prefix_cache.py) and runs them through one runner (runner.py; tp.py under tensor parallelism).
It builds on kivi_models (the patched model, prefill, the decode step); nothing below imports it."""
