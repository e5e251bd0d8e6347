"""`kivi serve`'s machinery, installed as kivi_serve (docs/serve.md; the module map: docs/design.md)."""
