"""Single controller over Ray: MegatronModel(..., remote_group='actor') in a
driver process returns a RemoteMegatronModel, which starts one Ray actor per
rank of the device mesh, lets their collectives meet (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, ... set in each actor before its MegatronModel
creates the world: NCCL on GPUs, Gloo on CPUs) and dispatches each call:

- forward_backward / forward_only: the batch is split into dp_size contiguous
  slices (Twinkle's slice_dp); every rank of data-parallel replica d gets
  slice d; the result is that of the output ranks (last pipeline stage, tp
  and cp rank 0), per-sample lists concatenated in dp order.
- every other method goes to all ranks and returns the output rank's result
  (dp replica 0's).

A call waits with ray.wait; when an actor dies, or ranks are still busy a
short grace after another failed (stuck in a collective), the group's actors
are killed, the handle is closed and the error (rank named) is raised. An
error that every rank finished with (bad input seen by one replica reaches
the others through the library) leaves the group usable. Ctrl-C kills the
group and re-raises. Ray is an optional extra: pip install 'loom-train[ray]'.
"""
import os
import re
import socket
import time
import types

import numpy as np

from .errors import (CommError, ConfigError, InternalError, InvalidArgumentError, LoomError,
                     ShapeError, UnsupportedError)
from .mesh import DeviceMesh

_INSTALL = "pip install 'loom-train[ray]' (or pip install ray)"
_GRACE_S = 10.0           # how long the other ranks may take to finish after one failed
_SPLIT = ("forward_backward", "forward_only")
_PER_SAMPLE = ("logps", "entropy", "logits")
_RAY_KWARGS = ("num_cpus_per_actor", "use_placement_group")
_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "LOOM_COMM_BACKEND")


def _ray():
    try:
        import ray
    except ImportError:
        raise UnsupportedError("loom's single controller runs on Ray, which is not installed; "
                               + _INSTALL)
    return ray


def init_ray(address=None, num_cpus=None, num_gpus=None, namespace=None, **ray_init_kwargs):
    """Connects to a Ray cluster (address='auto' or 'ray://host:port') or starts
    one on this machine (address None: num_cpus / num_gpus set its logical
    resources). Returns ray.init's context; a second call returns None."""
    ray = _ray()
    if ray.is_initialized():
        return None
    kw = dict(ray_init_kwargs)
    for k, v in (("address", address), ("num_cpus", num_cpus), ("num_gpus", num_gpus),
                 ("namespace", namespace)):
        if v is not None:
            kw[k] = v
    kw.setdefault("include_dashboard", False)
    kw.setdefault("logging_level", "warning")
    try:
        return ray.init(**kw)
    except (ConnectionError, ValueError, TypeError, RuntimeError) as e:
        raise ConfigError("loom.init(mode='ray'): ray.init(%s) failed: %s" % (
            ", ".join("%s=%r" % kv for kv in sorted(kw.items())), e))


class _Rank:
    """One rank of a remote group, in its Ray actor."""

    def node(self):
        import ray
        return ray.util.get_node_ip_address(), os.getpid()

    def free_port(self):
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def setup(self, env, args, kwargs):
        os.environ.update(env)  # before the library creates the world
        from .model import MegatronModel
        self.m = MegatronModel(*args, **kwargs)
        i = self.m.info
        return dict(self.m.mesh_coords(), vocab_size=i.vocab_size, hidden_size=i.hidden_size,
                    num_layers=i.num_layers, num_params=i.num_params,
                    model_type=i.model_type.decode(), device=self.m.device)

    def call(self, name, args, kwargs):
        return getattr(self.m, name)(*args, **kwargs)

    def call_with(self, name, inputs, args, kwargs):
        # inputs: this rank's data-parallel slice (a top-level ref, so Ray resolves it)
        return getattr(self.m, name)(inputs, *args, **kwargs)


def _slices(what, inputs, dp):
    """inputs cut into dp contiguous, equal slices (a list of samples, or a
    dict whose 2-D input_ids splits by rows with every array of as many rows)."""
    if isinstance(inputs, dict):
        ids = inputs.get("input_ids")
        a = None if ids is None else np.asarray(ids) if not isinstance(ids, list) else None
        if a is None or a.ndim != 2:
            if dp == 1:
                return [inputs]
            raise ShapeError("%s: one sample (a dict without 2-D input_ids) cannot be split over "
                             "dp=%d ranks; give a list of samples or a dict of (rows, seq) arrays"
                             % (what, dp))
        n = a.shape[0]
        cols = {}
        for k, v in inputs.items():
            v = None if v is None else np.asarray(v)
            if v is not None and (v.ndim < 1 or v.shape[0] != n):
                raise ShapeError("%s: inputs[%r] has shape %s; input_ids has %d rows" % (
                    what, k, v.shape, n))
            cols[k] = v
        if n % dp:
            raise ShapeError("%s: the batch of %d samples cannot be split over dp=%d ranks; give "
                             "a multiple of %d" % (what, n, dp, dp))
        per = n // dp
        return [{k: None if v is None else v[d * per:(d + 1) * per] for k, v in cols.items()}
                for d in range(dp)]
    if isinstance(inputs, (str, bytes)) or not hasattr(inputs, "__len__"):
        raise InvalidArgumentError("%s: inputs must be a list of samples or a dict of arrays, "
                                   "not %s" % (what, type(inputs).__name__))
    n = len(inputs)
    if n % dp:
        raise ShapeError("%s: the batch of %d samples cannot be split over dp=%d ranks; give a "
                         "multiple of %d" % (what, n, dp, dp))
    per = n // dp
    return [list(inputs[d * per:(d + 1) * per]) for d in range(dp)]


class RemoteMegatronModel:
    """A MegatronModel whose ranks are Ray actors, driven from this process."""

    def __init__(self, model_id, config=None, device_mesh=None, mixed_precision="bf16",
                 remote_group=None, **kwargs):
        ray = _ray()
        from .model import _KWARGS, _check_kwargs
        self._actors, self._pg, self._dead = [], None, None
        if not isinstance(remote_group, str) or not remote_group:
            raise InvalidArgumentError("remote_group must be a non-empty str (e.g. 'actor'), not "
                                       "%r" % (remote_group,))
        self.remote_group = remote_group
        if not ray.is_initialized():
            raise ConfigError("MegatronModel(remote_group=%r): Ray is not running in this "
                              "process; call loom.init(mode='ray') first" % remote_group)
        ncpu = kwargs.pop("num_cpus_per_actor", 1)
        use_pg = bool(kwargs.pop("use_placement_group", True))
        _check_kwargs("MegatronModel", kwargs, _KWARGS | set(_RAY_KWARGS))
        if isinstance(ncpu, bool) or not isinstance(ncpu, (int, float)) or not ncpu > 0:
            raise InvalidArgumentError("num_cpus_per_actor=%r must be a number > 0 (fractions "
                                       "share a core)" % (ncpu,))
        if device_mesh is None:
            device_mesh = DeviceMesh.from_sizes()
        if not isinstance(device_mesh, DeviceMesh):
            raise InvalidArgumentError("device_mesh must be a loom.DeviceMesh (DeviceMesh."
                                       "from_sizes(...)), not %s" % type(device_mesh).__name__)
        self.device_mesh = mesh = device_mesh
        self.world_size = n = mesh.world_size
        from . import _lib as L
        res = ray.cluster_resources()
        dev = kwargs.get("device", "auto")
        if dev == "auto":
            dev = "cuda" if "cuda" in L.features() and res.get("GPU", 0) >= 1 else "cpu"
        if dev not in ("cpu", "cuda"):
            raise InvalidArgumentError("device=%r: use 'cpu', 'cuda' or 'auto'" % (dev,))
        kwargs["device"] = self.device = dev
        ngpu = 1 if dev == "cuda" else 0
        if dev == "cpu" and n > 1 and "gloo" not in L.features():
            raise UnsupportedError("remote_group=%r: %d CPU ranks over Ray need loom's Gloo "
                                   "backend, and this loom was built without it; install "
                                   "libgloo-dev and rebuild (or use one rank, or GPUs)"
                                   % (remote_group, n))
        need = {"CPU": ncpu * n, "GPU": ngpu * n}
        for k, v in need.items():
            if v > res.get(k, 0) + 1e-9:
                raise ConfigError("remote_group=%r: %d actors need %g %s(s) (%g each%s), the Ray "
                                  "cluster has %g; lower num_cpus_per_actor, shrink the mesh or "
                                  "add nodes" % (remote_group, n, v, k, v / n, "" if k == "GPU"
                                                 else ", num_cpus_per_actor", res.get(k, 0)))
        bundle = {"CPU": ncpu}
        if ngpu:
            bundle["GPU"] = ngpu
        try:
            self._start(ray, bundle, use_pg, ncpu)
            self._setup(ray, (model_id,), dict(config=config, device_mesh=mesh,
                                               mixed_precision=mixed_precision, **kwargs))
        except BaseException:
            self._kill()
            raise

    # ---- starting the group ----
    def _start(self, ray, bundle, use_pg, ncpu):
        n = self.world_size
        opts = {"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0),
                "runtime_env": {"env_vars": self._worker_env(ncpu)}, "max_restarts": 0}
        strat = [None] * n
        if use_pg:
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
            one = any(all(nd["Resources"].get(k, 0) >= v * n for k, v in bundle.items())
                      for nd in ray.nodes() if nd.get("Alive"))
            self._pg = placement_group([dict(bundle) for _ in range(n)],
                                       strategy="STRICT_PACK" if one else "PACK")
            ready, _ = ray.wait([self._pg.ready()], timeout=_placement_timeout())
            if not ready:
                raise ConfigError("remote_group=%r: Ray could not place %d actors of %s within "
                                  "%g s; free resources: %s (other groups or tasks hold the "
                                  "rest?)" % (self.remote_group, n, bundle, _placement_timeout(),
                                              ray.available_resources()))
            strat = [PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=r)
                     for r in range(n)]
        cls = ray.remote(_Rank)
        for r in range(n):
            o = dict(opts)
            if strat[r] is not None:
                o["scheduling_strategy"] = strat[r]
            self._actors.append(cls.options(**o).remote())

    @staticmethod
    def _worker_env(ncpu):
        """What an actor's process needs before it imports loom: the package
        (a source checkout is not on the workers' path), the driver's LOOM_*
        settings, one OpenMP thread per CPU share."""
        import site
        pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {k: v for k, v in os.environ.items()
               if k.startswith("LOOM_") and k not in _RANK_VARS}
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if pkg not in site.getsitepackages() + [site.getusersitepackages()]:
            paths.insert(0, pkg)  # a source checkout
        if paths:
            env["PYTHONPATH"] = os.pathsep.join(paths)
        env["OMP_NUM_THREADS"] = str(max(1, int(ncpu)))
        return env

    def _setup(self, ray, args, kwargs):
        n, mesh = self.world_size, self.device_mesh
        nodes = self._gather([a.node.remote() for a in self._actors], "starting the actors")
        self.pids = [pid for _, pid in nodes]
        port = self._gather([self._actors[0].free_port.remote()], "picking a port", ranks=[0])[0]
        ips = [ip for ip, _ in nodes]
        envs = []
        for r in range(n):
            same = [q for q in range(n) if ips[q] == ips[r]]
            envs.append({"RANK": str(r), "WORLD_SIZE": str(n),
                         "LOCAL_RANK": "0" if self.device == "cuda" else str(same.index(r)),
                         "LOCAL_WORLD_SIZE": str(len(same)), "MASTER_ADDR": ips[0],
                         "MASTER_PORT": str(port),
                         "LOOM_COMM_BACKEND": "gloo" if n > 1 else "single"})
            if self.device == "cuda":
                del envs[-1]["LOOM_COMM_BACKEND"]
        self.master = "%s:%d" % (ips[0], port)
        infos = self._gather([a.setup.remote(envs[r], args, kwargs)
                              for r, a in enumerate(self._actors)], "MegatronModel")
        for r, c in enumerate(infos):
            want = mesh.coords(r)
            if (c["tp_rank"], c["cp_rank"], c["dp_rank"], c["pp_rank"]) != want:
                raise InternalError("remote_group=%r: rank %d's library mesh coordinates %s "
                                    "differ from DeviceMesh's %s" % (self.remote_group, r, c, want))
        out = self._out_ranks()
        self.info = types.SimpleNamespace(**{k: v for k, v in infos[out[0]].items()
                                             if k not in ("rank", "is_output_rank")})

    def _out_ranks(self):
        """The output rank of each dp replica, in dp order."""
        m = self.device_mesh
        out = [None] * m.dp_size
        for r in range(self.world_size):
            if m.is_output_rank(r):
                out[m.dp_rank_of(r)] = r
        return out

    # ---- waiting, failures ----
    def _where(self, r):
        t, c, d, p = self.device_mesh.coords(r)
        s = "rank %d (dp %d, tp %d, pp %d" % (r, d, t, p)
        return s + (", cp %d)" % c if self.device_mesh.cp_size > 1 else ")")

    def _gather(self, refs, what, ranks=None, notes=None):
        """ray.get of one ref per rank, never hanging: see the module. notes:
        rank -> words added to that rank's error."""
        ray = _ray()
        ranks = list(range(len(refs))) if ranks is None else ranks
        pending = dict(zip(refs, ranks))
        results, errors, dead, t_err = {}, {}, None, None
        try:
            while pending and dead is None:
                left = None if t_err is None else t_err + _GRACE_S - time.monotonic()
                if left is not None and left <= 0:
                    break
                ready, _ = ray.wait(list(pending), num_returns=len(pending),
                                    timeout=0.5 if left is None else min(0.5, left))
                for ref in ready:
                    r = pending.pop(ref)
                    try:
                        results[r] = ray.get(ref)
                    except ray.exceptions.RayActorError as e:
                        dead = r
                        errors[r] = CommError(
                            "remote group %r: the actor of %s died during %s (%s); the group's "
                            "other actors were stopped: make a new MegatronModel" % (
                                self.remote_group, self._where(r), what,
                                str(e).strip().splitlines()[0] if str(e).strip() else
                                type(e).__name__))
                    except ray.exceptions.RayTaskError as e:
                        errors[r] = self._rank_error(r, e, (notes or {}).get(r, ""))
                    except ray.exceptions.RayError as e:  # the worker or its objects were lost
                        dead = r
                        errors[r] = CommError("remote group %r: %s was lost during %s (%s: %s); "
                                              "the group's other actors were stopped" % (
                                                  self.remote_group, self._where(r), what,
                                                  type(e).__name__, e))
                    if r in errors and t_err is None:
                        t_err = time.monotonic()
        except KeyboardInterrupt:
            self._kill("interrupted (Ctrl-C) during %s" % what)
            raise
        if not errors:
            return [results[r] for r in ranks]
        if dead is not None or pending:
            stuck = sorted(pending.values())
            self._kill("%s failed on %s" % (what, self._where(dead if dead is not None
                                                               else min(errors))))
            if dead is None:
                e = _root(errors)
                e.args = (e.args[0] + " (ranks %s were still busy %g s later, so the group's "
                          "actors were stopped: make a new MegatronModel)" % (
                              ", ".join(map(str, stuck)), _GRACE_S),) + e.args[1:]
                raise e
            raise errors[dead]
        raise _root(errors)  # every rank finished: the group goes on

    def _rank_error(self, r, e, note=""):
        cause = getattr(e, "cause", None) or e
        msg = "remote group %r, %s%s: %s" % (self.remote_group, self._where(r), note, cause)
        if isinstance(cause, LoomError):
            out = type(cause)(msg, getattr(cause, "status", 0))
        else:
            try:
                out = type(cause)(msg)
            except Exception:
                out = InternalError(msg)
        out.rank, out.own_message = r, str(cause)
        return out

    def _kill(self, why=None):
        ray = _ray()
        for a in self._actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        if self._pg is not None:
            try:
                from ray.util.placement_group import remove_placement_group
                remove_placement_group(self._pg)
            except Exception:
                pass
        self._actors, self._pg = [], None
        if self._dead is None:
            self._dead = why or "closed"

    def close(self):
        """Stops the group's actors (the handle is unusable afterwards)."""
        if self._actors or self._pg is not None:
            self._kill("closed")

    shutdown = close

    def __del__(self):
        try:
            if self._actors and _ray().is_initialized():
                self._kill("closed")
        except Exception:
            pass

    # ---- dispatch ----
    def _check(self, name):
        if self._dead is not None:
            raise ConfigError("remote group %r cannot run %s: its actors were stopped (%s)"
                              % (self.remote_group, name, self._dead))

    def call_ranks(self, name, *args, **kwargs):
        """Calls a MegatronModel method on every rank; returns every rank's result."""
        self._check(name)
        return self._gather([a.call.remote(name, args, kwargs) for a in self._actors], name)

    def _split_call(self, name, args, kwargs):
        ray = _ray()
        self._check(name)
        if args:
            inputs, args = args[0], args[1:]
        else:
            inputs = kwargs.pop("inputs", None)
        if inputs is None:
            raise InvalidArgumentError("%s: inputs is required" % name)
        m = self.device_mesh
        sl = _slices(name, inputs, m.dp_size)
        parts = [ray.put(p) for p in sl]
        per = len(sl[0]) if isinstance(sl[0], list) else None
        notes = {} if per is None or m.dp_size == 1 else {
            r: ", whose inputs[0..%d] are the call's inputs[%d..%d]" % (
                per - 1, m.dp_rank_of(r) * per, (m.dp_rank_of(r) + 1) * per - 1)
            for r in range(self.world_size)}
        refs = [a.call_with.remote(name, parts[m.dp_rank_of(r)], args, kwargs)
                for r, a in enumerate(self._actors)]
        res = self._gather(refs, name, notes=notes)
        outs = [res[r] for r in self._out_ranks()]
        out = outs[0]
        for k in _PER_SAMPLE:
            if k in out:
                out[k] = [x for o in outs for x in o[k]]
        return out

    def __getattr__(self, name):
        from .model import MegatronModel
        if name.startswith("_") or not callable(getattr(MegatronModel, name, None)):
            raise AttributeError("%r: RemoteMegatronModel has no attribute %r (MegatronModel's "
                                 "methods are run on the actors; call_ranks(name) returns every "
                                 "rank's result)" % (self.remote_group, name))
        if name in _SPLIT:
            return lambda *a, **kw: self._split_call(name, a, kw)

        def call(*args, **kwargs):
            return self.call_ranks(name, *args, **kwargs)[self._out_ranks()[0]]
        call.__name__ = name
        return call

    def __repr__(self):
        return "RemoteMegatronModel(group=%r, %r, %d actors, %s%s)" % (
            self.remote_group, self.device_mesh, len(self._actors), self.device,
            "" if self._dead is None else ", stopped: " + self._dead)


def _root(errors):
    """The error to raise of {rank: error}: the one a rank found in its own
    inputs rather than a peer's echo of it ("rank 2 refused its batch"): an
    error the Python layer raised (status 0) before a library error, a
    CommError last, then the lowest rank; an echo naming a rank that failed
    gives way to that rank's error."""
    e = min(errors.items(), key=lambda kv: (isinstance(kv[1], CommError),
                                            getattr(kv[1], "status", 0) != 0, kv[0]))[1]
    m = re.search(r"\brank (\d+) refused its batch", getattr(e, "own_message", ""))
    if m and int(m.group(1)) in errors:
        e = errors[int(m.group(1))]
    return e


def _placement_timeout():
    try:
        return float(os.environ.get("LOOM_RAY_PLACEMENT_TIMEOUT", "60"))
    except ValueError:
        raise ConfigError("LOOM_RAY_PLACEMENT_TIMEOUT=%r is not a number of seconds"
                          % os.environ["LOOM_RAY_PLACEMENT_TIMEOUT"])
