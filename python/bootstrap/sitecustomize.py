"""trainyard's bootstrap: step receipts from a Python training script nobody changed.

The trainyard agent puts the directory holding this file first on a Python rank's PYTHONPATH
(with its own copy of `trainyard_receipts` beside it), so every interpreter of the rank imports
it at start-up, as Python imports any `sitecustomize`. It does three small things and imports
nothing heavy:

1. runs the `sitecustomize` the environment already had (the next one on sys.path), so a site's
   own start-up code still runs; one that raises is reported on stderr and the script goes on,
   as Python itself does;
2. decides whether this interpreter is a rank's own process: TRAINYARD_RECEIPTS set,
   TRAINYARD_RECEIPTS_AUTO not "0", and not a child of a rank that already claimed the file
   (DataLoader workers, compile workers, any Python a rank starts: they inherit
   TRAINYARD_RECEIPTS_OWNER), nor a `torchrun` launcher: of a torchrun inside the job (its
   TORCHELASTIC_RUN_ID is not the job's), the first local worker writes the trainyard rank's
   receipts and the others write none;
3. watches the imports of the script: when it imports torch (and wandb, MLflow, TensorBoard,
   Hugging Face's Trainer),
   `trainyard_receipts._auto` hooks into them. Until then nothing else happens, and a script
   that never imports torch costs a dictionary lookup per import.

Nothing here may stop the user's script: every failure is one line on stderr.
"""


def _trainyard_bootstrap():
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))

    def warn(message):
        try:
            sys.stderr.write("trainyard bootstrap: %s\n" % message)
        except Exception:
            pass

    def chain():
        """Runs the next `sitecustomize` on sys.path, the one this file shadows. Through the
        import system's own path finder, already loaded, so that chaining imports nothing."""
        from _frozen_importlib_external import PathFinder

        rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
        spec = PathFinder.find_spec("sitecustomize", rest)
        if spec is None or spec.loader is None:
            return
        module = type(sys)("sitecustomize")
        module.__spec__, module.__loader__, module.__file__ = spec, spec.loader, spec.origin
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # as site.py does for a failing sitecustomize
            warn("the environment's sitecustomize (%s) raised %s: %s; the script goes on"
                 % (spec.origin, type(e).__name__, e))

    try:
        chain()
    except Exception as e:
        warn("could not look for the environment's sitecustomize: %s" % e)

    env = os.environ
    if not env.get("TRAINYARD_RECEIPTS") or env.get("TRAINYARD_RECEIPTS_AUTO", "1") == "0":
        return
    job = env.get("TRAINYARD_JOB_ID")
    if job and env.get("TORCHELASTIC_RUN_ID") != "trainyard-job-" + job and env.get("LOCAL_RANK", "0") != "0":
        # A worker of a torchrun the job started itself: the trainyard rank has one receipts
        # file, so the first local worker writes its receipts, the others none.
        return
    rank = env.get("RANK", "")
    owner = env.get("TRAINYARD_RECEIPTS_OWNER")
    if owner is not None and owner.partition(":")[2] == rank:
        return  # a child of the rank (same RANK): the rank's own process writes its receipts

    watched = {
        "torch": "torch",
        "wandb.sdk.wandb_run": "wandb",
        "mlflow.tracking.client": "mlflow",
        "torch.utils.tensorboard.writer": "tensorboard",
        "tensorboardX.writer": "tensorboardX",
        "transformers.trainer": "transformers",
    }

    class Loader:
        """Runs the real loader, then hands the module to trainyard_receipts._auto."""

        def __init__(self, real, what):
            self.real, self.what = real, what

        def create_module(self, spec):
            return self.real.create_module(spec)

        def exec_module(self, module):
            spec = module.__spec__
            spec.loader = module.__loader__ = self.real  # the module sees its own loader
            self.real.exec_module(module)
            try:
                from trainyard_receipts import _auto

                _auto.imported(self.what, module)
            except Exception as e:
                warn("not recording %s: %s: %s" % (self.what, type(e).__name__, e))

    class Watch:
        """A meta-path finder that finds nothing itself: it wraps the loader of the watched
        modules so that trainyard acts once they are imported."""

        busy = False

        def find_spec(self, name, path=None, target=None):
            what = watched.get(name)
            if what is None or self.busy:
                return None
            self.busy = True
            try:
                for finder in sys.meta_path:
                    if finder is self or not hasattr(finder, "find_spec"):
                        continue
                    spec = finder.find_spec(name, path, target)
                    if spec is not None:
                        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                            spec.loader = Loader(spec.loader, what)
                        return spec
                return None
            finally:
                self.busy = False

    sys.meta_path.insert(0, Watch())


try:
    _trainyard_bootstrap()
except Exception as _e:  # never stop the user's script
    import sys as _sys

    _sys.stderr.write("trainyard bootstrap: disabled: %s: %s\n" % (type(_e).__name__, _e))
del _trainyard_bootstrap
