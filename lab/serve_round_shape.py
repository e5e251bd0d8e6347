"""Issue 51's serving-round numbers: lines of serve/ executed by one paged request's rounds (engine
thread, after warm-up), and the project files on its path (tests/test_request_path.py's hook)."""
import collections
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import serve_fixtures as sf  # noqa: E402
from test_request_path import KERNEL_DIR, project_files  # noqa: E402

from kivi_serve.request import Request  # noqa: E402

def tiny():
    from transformers import AutoTokenizer
    from kivi_models.loading import default_model_dir
    from kivi_models import patch_model
    from tiny_models import tiny_llama
    tok = AutoTokenizer.from_pretrained(default_model_dir(), local_files_only=True)
    return patch_model(tiny_llama(vocab_size=len(tok), max_position_embeddings=256)), tok

SERVE = str(ROOT / "serve") + "/"
lines, files = set(), set()
on = threading.Event()
def tracer(frame, event, arg):
    if not on.is_set() or threading.current_thread().name == "kivi-watchdog":
        return None
    f = frame.f_code.co_filename
    if event == "call" and f.startswith(KERNEL_DIR) and not frame.f_code.co_name.startswith("_"):
        files.update(project_files(frame))
    if f.startswith(SERVE):
        def local(fr, ev, a):
            if ev == "line":
                lines.add((fr.f_code.co_filename, fr.f_lineno))
            return local
        lines.add((f, frame.f_lineno))
        return local
    return None

def main(argv=None) -> None:
    t = tiny()
    for chunk in (None, 8):
        lines.clear(); files.clear()
        threading.settrace(tracer); sys.settrace(tracer)
        engine = sf.make_engine(t, "kivi", 24, page_size=4, prefix_chunk=chunk)
        assert engine.ready.wait(300)
        done = threading.Event()
        on.set()
        ids = t[1]("The capital of France is a city")["input_ids"]
        engine.submit(Request(prompt_ids=ids, max_tokens=4, temperature=0, emit=lambda k, p: done.set() if k in ("done", "error") else None))
        assert done.wait(120)
        on.clear(); sys.settrace(None); threading.settrace(None)
        engine.close()
        by_file = collections.Counter(Path(f).name for f, _ in lines)
        print(f"prefix_chunk={chunk}: serve/ lines executed {len(lines)} {dict(sorted(by_file.items()))}; "
              f"project files on the kernel stacks {len(files)}")
