"""DeviceMesh: the parallel layout, as Twinkle's DeviceMesh.from_sizes gives it.

Sizes are those of the CLI's --dp/--tp/--pp/--cp/--ep/--etp/--vpp and
--sequence-parallel; ranks are ordered as Megatron orders them (tp fastest,
then cp, dp, pp): rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank)).
Expert layers (MoE models) fold each pipeline stage's tp*cp*dp ranks into
etp x ep x edp, etp fastest (Megatron's MoE parallel folding); etp_size None
is tp_size, as in Megatron and Twinkle. ep and etp add no ranks: the world
is dp*tp*pp*cp either way.
"""
import os

from .errors import InvalidArgumentError, MeshError

_WORLD_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")


def launcher_world():
    """(rank, world size, variable) from the launcher's environment; (0, 1, None) alone."""
    for wv, rv in zip(_WORLD_VARS, _RANK_VARS):
        if os.environ.get(wv):
            try:
                return int(os.environ.get(rv, "0")), int(os.environ[wv]), wv
            except ValueError:
                raise MeshError("the launcher's %s=%r or %s=%r is not a number"
                                % (wv, os.environ.get(wv), rv, os.environ.get(rv)))
    return 0, 1, None


def _size(name, v, default):
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidArgumentError("DeviceMesh.from_sizes: %s=%r must be an int" % (name, v))
    if v < 1:
        raise MeshError("DeviceMesh.from_sizes: %s=%d must be >= 1" % (name, v))
    return v


class DeviceMesh:
    """Sizes of tensor (tp), context (cp), data (dp), pipeline (pp, with vpp
    virtual stages per rank), expert (ep, etp) parallelism, and sequence
    parallelism on tp. ep_size and etp_size fold the expert layers; the
    library checks them against the model (ep dividing num_experts, etp
    moe_intermediate_size, etp*ep dividing tp*cp*dp, sequence parallelism
    when tp > 1 unless ep is 1 and etp is tp) and a dense model refuses
    them, with MeshError, before any compute."""

    def __init__(self, dp_size, tp_size=1, pp_size=1, cp_size=1, ep_size=1, etp_size=None,
                 vpp_size=None, sequence_parallel=False):
        self.dp_size = dp_size
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.cp_size = cp_size
        self.ep_size = ep_size
        self.etp_size = etp_size
        self.vpp_size = vpp_size
        self.sequence_parallel = bool(sequence_parallel)

    @classmethod
    def from_sizes(cls, dp_size=None, tp_size=1, pp_size=1, cp_size=1, ep_size=1, etp_size=None,
                   vpp_size=None, sequence_parallel=False, world_size=None):
        """dp_size None: what the world leaves (the launcher's world size, or 1
        without a launcher). Raises MeshError, with the numbers named, when the
        sizes do not multiply to the world size."""
        tp = _size("tp_size", tp_size, 1)
        pp = _size("pp_size", pp_size, 1)
        cp = _size("cp_size", cp_size, 1)
        ep = _size("ep_size", ep_size, 1)
        etp = _size("etp_size", etp_size, None)
        vpp = _size("vpp_size", vpp_size, None)
        if vpp is not None and vpp > 1 and pp == 1:
            raise MeshError("DeviceMesh.from_sizes: vpp_size=%d needs pp_size > 1 (virtual "
                            "stages interleave a pipeline)" % vpp)
        if world_size is None:
            _, world, var = launcher_world()
        else:
            world, var = _size("world_size", world_size, 1), "world_size"
        mp = tp * pp * cp
        if dp_size is None:
            if var is None:
                dp = 1
            elif world % mp:
                raise MeshError("DeviceMesh.from_sizes: the world of %d processes (%s) is not "
                                "divisible by tp=%d x pp=%d x cp=%d = %d; start a multiple of "
                                "%d processes or change the sizes" % (world, var, tp, pp, cp, mp, mp))
            else:
                dp = world // mp
        else:
            dp = _size("dp_size", dp_size, 1)
        if var is not None and dp * mp != world:
            raise MeshError("DeviceMesh.from_sizes: dp=%d x tp=%d x pp=%d x cp=%d = %d "
                            "processes, but the world has %d (%s); make the product equal the "
                            "number of processes" % (dp, tp, pp, cp, dp * mp, world, var))
        return cls(dp, tp, pp, cp, ep, etp, vpp, sequence_parallel)

    @property
    def world_size(self):
        return self.dp_size * self.tp_size * self.pp_size * self.cp_size

    @property
    def etp_world_size(self):
        """The experts' tensor-parallel size: etp_size, or tp_size when None."""
        return self.etp_size if self.etp_size is not None else self.tp_size

    @property
    def edp_size(self):
        """The expert layers' data-parallel size, tp*cp*dp / (etp*ep) (0: does not divide)."""
        stage, fold = self.tp_size * self.cp_size * self.dp_size, self.etp_world_size * self.ep_size
        return stage // fold if stage % fold == 0 else 0

    # Twinkle's names
    dp_world_size = property(lambda self: self.dp_size)
    data_world_size = property(lambda self: self.dp_size)
    tp_world_size = property(lambda self: self.tp_size)
    pp_world_size = property(lambda self: self.pp_size)
    cp_world_size = property(lambda self: self.cp_size)
    ep_world_size = property(lambda self: self.ep_size)

    def coords(self, rank):
        """(tp_rank, cp_rank, dp_rank, pp_rank) of a world rank."""
        t, c, d = self.tp_size, self.cp_size, self.dp_size
        return rank % t, rank // t % c, rank // (t * c) % d, rank // (t * c * d)

    def expert_coords(self, rank):
        """(etp_rank, ep_rank, edp_rank, pp_rank) of a world rank under the expert fold."""
        t, c, d = self.tp_size, self.cp_size, self.dp_size
        s, e = rank % (t * c * d), self.etp_world_size
        return s % e, s // e % self.ep_size, s // (e * self.ep_size), rank // (t * c * d)

    def dp_rank_of(self, rank):
        return self.coords(rank)[2]

    def is_output_rank(self, rank):
        """The rank that returns a replica's results: last pipeline stage, tp and cp rank 0."""
        t, c, _, p = self.coords(rank)
        return t == 0 and c == 0 and p == self.pp_size - 1

    def __repr__(self):
        s = "DeviceMesh(dp=%d, tp=%d, pp=%d, cp=%d" % (self.dp_size, self.tp_size, self.pp_size,
                                                       self.cp_size)
        if self.vpp_size and self.vpp_size > 1:
            s += ", vpp=%d" % self.vpp_size
        if self.ep_size > 1 or self.etp_world_size != self.tp_size:
            s += ", ep=%d, etp=%d" % (self.ep_size, self.etp_world_size)
        if self.sequence_parallel:
            s += ", sequence_parallel=True"
        return s + ")"

    def __eq__(self, o):
        return isinstance(o, DeviceMesh) and repr(self) == repr(o)
