"""Model ids to local directories: a directory, or `ms://Org/Name`,
`hf://Org/Name`, `Org/Name` found in the local ModelScope and Hugging Face
caches. loom never downloads; a model not found raises NotFoundError naming
every place looked in."""
import os

from .errors import InvalidArgumentError, NotFoundError


def _is_model_dir(d):
    return os.path.isfile(os.path.join(d, "config.json"))


def _hf_roots():
    if os.environ.get("HF_HUB_CACHE"):
        yield os.environ["HF_HUB_CACHE"]
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):
        yield os.environ["HUGGINGFACE_HUB_CACHE"]
    home = os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface"))
    yield os.path.join(home, "hub")


def _ms_roots():
    if os.environ.get("MODELSCOPE_CACHE"):
        root = os.environ["MODELSCOPE_CACHE"]
        yield os.path.join(root, "models")
        yield os.path.join(root, "hub")
        yield root
    root = os.path.join(os.path.expanduser("~"), ".cache", "modelscope", "hub")
    yield os.path.join(root, "models")
    yield root


def _hf_lookup(name, looked):
    for root in _hf_roots():
        repo = os.path.join(root, "models--" + name.replace("/", "--"))
        snaps = os.path.join(repo, "snapshots")
        looked.append(snaps)
        ref = os.path.join(repo, "refs", "main")
        if os.path.isfile(ref):
            with open(ref) as f:
                d = os.path.join(snaps, f.read().strip())
            if _is_model_dir(d):
                return d
        if os.path.isdir(snaps):
            for rev in sorted(os.listdir(snaps)):
                d = os.path.join(snaps, rev)
                if _is_model_dir(d):
                    return d
    return None


def _ms_lookup(name, looked):
    org, _, model = name.partition("/")
    # ModelScope's cache spells '.' in names as '___'
    for m in dict.fromkeys((model, model.replace(".", "___"))):
        for root in _ms_roots():
            d = os.path.join(root, org, m)
            looked.append(d)
            if _is_model_dir(d):
                return d
    return None


def resolve_model(model_id):
    """The local directory of a model id (see the module's text)."""
    if not isinstance(model_id, (str, os.PathLike)):
        raise InvalidArgumentError("model_id must be a str (a directory or 'Org/Name'), not %s"
                                   % type(model_id).__name__)
    model_id = os.fspath(model_id)
    if os.path.isdir(model_id):
        if not _is_model_dir(model_id):
            raise NotFoundError("model_id %r is a directory without config.json; give a Hugging "
                                "Face model directory" % model_id)
        return os.path.abspath(model_id)
    looked = [os.path.abspath(model_id)]
    scheme, name = None, model_id
    for s in ("ms://", "hf://", "modelscope://", "huggingface://"):
        if model_id.startswith(s):
            scheme, name = s[:2], model_id[len(s):]
    if name.count("/") != 1 or name.startswith("/"):
        raise NotFoundError("model %r: no such directory, and not an 'Org/Name' id" % model_id)
    order = {"ms": (_ms_lookup,), "hf": (_hf_lookup,), "mo": (_ms_lookup,),
             "hu": (_hf_lookup,)}.get(scheme, (_hf_lookup, _ms_lookup))
    for f in order:
        d = f(name, looked)
        if d:
            return d
    raise NotFoundError("model %r is not in the local caches (loom does not download); looked "
                        "in: %s. Download it first (e.g. `modelscope download %s` or "
                        "`huggingface-cli download %s`) or pass its directory"
                        % (model_id, ", ".join(looked), name, name))
