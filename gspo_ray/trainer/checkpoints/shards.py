"""Who writes which bytes of a trainer checkpoint, and how a rank of another layout reads them back (resharding).

    owners = Owners(layouts, rank)                      # layouts: every rank's `TrainerWorker.layout()`
    model = owned_model_state(state, owners)             # the tensors this rank writes
    pieces = optimizer_pieces(optimizer, names, owners, fp32=True)
    ...
    saved = SavedShards(ckpt_dir, meta, spec)            # spec: this trainer's ModelSpec (its tp / ep)
    state = saved.model_state(layout, keys)              # this rank's model, from any DP / TP / EP layout
    saved.load_optimizer(optimizer, names, layout, fp32=True)

Every byte once. Model tensors depend only on the TP rank (dense) or the EP rank (experts; expert-TP is 1), so the
first rank with a given (tp_rank, pp_rank) writes the dense tensors and the first with a given (ep_rank, etp_rank,
pp_rank) the expert ones; the other DP ranks hold copies and write none. Optimizer state is written per parameter
as slices of its flattened local tensor (`start` + flat exp_avg / exp_avg_sq / fp32 main param): with the
distributed optimizer each DP rank writes the slice it updates (the DP ranks' slices tile the tensor); with a plain
optimizer, whose every DP rank holds all of it, only the model owner writes it, whole. At fp32 the main params are
the model params themselves and are not written again. What stays per rank: RNG states, schedule position (bytes).

Resharding on load. A rank rebuilds each tensor it needs in its own layout from the saved local tensors: the same
TP / EP coordinates -> only the saved slices that overlap the slice it needs are read (files are memory-mapped);
another TP size -> the saved TP shards are joined (`bridge.unshard_tp`, vocabulary padding kept; LoRA adapters by
`lora.adapters.adapter_tp_split`) and split again; another EP size -> expert j of EP rank e is global expert
e * local + j, read under its saved rank and name (SequentialMLP's `local_experts.{j}.` or TEGroupedMLP's
`weight{j}`).

Other layers (Transformer Engine's spec or the local one, grouped GEMM experts or not: trainer/weights/param_names.py):
a parameter this trainer names differently is read under the saved name of the same tensor, the one with its HF
tensors and local expert index (`param_names.param_key`): TE's fused norm weight is the norm's weight, grouped
expert j's `weight{j}` is SequentialMLP's expert j, same shape, same values. Module extra state (`_extra_state`:
TE's, a uint8 tensor, empty or its pickled FP8 scaling state; Megatron's local linears', None) is no tensor to
split or rename: it is kept as saved where this rank's module is the saved one (same layers, same TP for dense
modules, same EP for experts), else this trainer's own is kept (an FP8 scaling history restarts).
Pipeline stages: names are global (trainer/weights/stage_names.py: the layer index a tensor has at PP 1) and meta
"pp_layers" says which saved stage held which layers, so a tensor is read from its saved stage's owner whatever
this trainer's PP size (`saved_stage`); the embedding lives on the first stage, the final norm and output layer on
the last.

Megatron's own dist_checkpointing (torch_dist) was not used: see docs/async-and-failures.md ("Checkpoint layout").
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import Tensor

from gspo_ray.trainer.optim import sub_optimizers

EXPERT_KEY = ".experts."  # Megatron names of expert-parallel params contain this
EXTRA_STATE = "._extra_state"  # a module's extra state in a state dict (Transformer Engine's FP8 metadata)
# the local expert index in a name: SequentialMLP's `local_experts.{j}.`, TEGroupedMLP's `linear_fc{1,2}.weight{j}`
_LOCAL_EXPERT = (re.compile(r"\.local_experts\.(\d+)\."), re.compile(r"\.experts\.linear_fc[12]\.weight(\d+)$"))
FORMAT = 2  # meta.json "format": 2 = this layout; absent = every rank wrote its whole model and optimizer


class MissingShardError(ValueError):
    """A checkpoint whose saved slices do not cover a tensor (a rank file from another save, or edited)."""


def is_expert(name: str) -> bool:
    return EXPERT_KEY in name


def local_expert(name: str) -> int | None:
    """The local expert index in an expert tensor's name (None: the name has none, e.g. a grouped module's extra
    state)."""
    for pattern in _LOCAL_EXPERT:
        m = pattern.search(name)
        if m:
            return int(m.group(1))
    return None


def with_local_expert(name: str, index: int) -> str:
    """`name` with its local expert index replaced by `index`."""
    for pattern in _LOCAL_EXPERT:
        m = pattern.search(name)
        if m:
            return name[:m.start(1)] + str(index) + name[m.end(1):]
    raise ValueError(f"{name}: no local expert index")


class Owners:
    """Which saved rank writes (and holds) the dense and the expert tensors of each coordinate."""

    def __init__(self, layouts: list[dict], rank: int):
        self.layouts, self.rank = layouts, rank
        lay = layouts[rank]
        self.dense = self.dense_owner(lay["tp_rank"], lay["pp_rank"]) == rank
        self.expert = self.expert_owner(lay["ep_rank"], lay.get("etp_rank", 0), lay["pp_rank"]) == rank

    def _first(self, **want) -> int:
        for r, lay in enumerate(self.layouts):
            if all(lay.get(k, 0) == v for k, v in want.items()):
                return r
        raise MissingShardError(f"no saved rank with {want}")

    def dense_owner(self, tp_rank: int, pp_rank: int = 0) -> int:
        return self._first(tp_rank=tp_rank, pp_rank=pp_rank)

    def expert_owner(self, ep_rank: int, etp_rank: int = 0, pp_rank: int = 0) -> int:
        return self._first(ep_rank=ep_rank, etp_rank=etp_rank, pp_rank=pp_rank)

    def owns(self, name: str) -> bool:
        return self.expert if is_expert(name) else self.dense

    def holders(self, name: str, tp_rank: int, ep_rank: int, pp_rank: int = 0) -> list[int]:
        """Saved ranks whose files may hold slices of `name` at these coordinates (its DP group)."""
        key, value = ("ep_rank", ep_rank) if is_expert(name) else ("tp_rank", tp_rank)
        return [r for r, lay in enumerate(self.layouts) if lay[key] == value and lay.get("pp_rank", 0) == pp_rank]


def saved_stage(name: str, stage_layers: list[list[int]]) -> int:
    """The pipeline stage of a checkpoint that holds global `name`: the embedding on the first, a decoder layer on
    the stage whose [first, end) holds its index (meta "pp_layers"), the final norm and output layer on the last."""
    from gspo_ray.trainer.weights.stage_names import layer_index

    index = layer_index(name)
    if index is None:
        return 0 if name.startswith("embedding.") else len(stage_layers) - 1
    for stage, (first, end) in enumerate(stage_layers):
        if first <= index < end:
            return stage
    raise MissingShardError(f"layer {index} ({name}) is in no saved pipeline stage {stage_layers}")


def owned_model_state(state: dict, owners: Owners) -> dict:
    """The entries of this rank's model state dict that it writes (none when another DP rank holds the same)."""
    return {k: v for k, v in state.items() if owners.owns(k)}


# ---- optimizer slices ----------------------------------------------------------------------------------------------
def param_slots(sub) -> list[tuple[Tensor, Tensor, int]]:
    """(model param, main param, offset of the main param in the flattened model param) of one Megatron optimizer,
    in no particular order. Distributed optimizer: the main param is this DP rank's slice; bf16: an fp32 copy."""
    if hasattr(sub, "model_param_group_index_map"):  # DistributedOptimizer
        out = []
        for model_param, (gi, go) in sub.model_param_group_index_map.items():
            main = sub.optimizer.param_groups[gi]["params"][go]
            # the slice [start, end) of the flattened param this rank updates (megatron has no public accessor)
            start = sub._get_model_param_range_map(model_param)["param"].start
            out.append((model_param, main, start))
        return out
    if hasattr(sub, "float16_groups"):  # Float16OptimizerWithFloat16Params: fp32 copies of the bf16 params
        pairs = [(m, p) for mg, pg in zip(sub.float16_groups, sub.fp32_from_float16_groups) for m, p in zip(mg, pg)]
        pairs += [(p, p) for g in sub.fp32_from_fp32_groups for p in g]
        return [(m, p, 0) for m, p in pairs]
    return [(p, p, 0) for g in sub.optimizer.param_groups for p in g["params"]]  # FP32Optimizer


def is_distributed(sub) -> bool:
    return hasattr(sub, "model_param_group_index_map")


def optimizer_pieces(optimizer, names: dict[int, str], owners: Owners, fp32: bool) -> dict:
    """{"params": {name: {"start", "shape", "step", "exp_avg", "exp_avg_sq"[, "main"]}}, "scalers": [...]}: the
    slices this rank writes (see the module doc). `names`: id(model param) -> its state-dict name."""
    params, scalers = {}, []
    for sub in sub_optimizers(optimizer):
        scalers.append(sub.grad_scaler.state_dict() if getattr(sub, "grad_scaler", None) else None)
        distributed = is_distributed(sub)
        for model_param, main, start in param_slots(sub):
            name = names[id(model_param)]
            state = sub.optimizer.state.get(main)
            if not state or not (distributed or owners.owns(name)):
                continue
            piece = {"start": start, "shape": list(model_param.shape), "step": state["step"].clone()}
            piece["exp_avg"] = state["exp_avg"].detach().reshape(-1).clone()
            piece["exp_avg_sq"] = state["exp_avg_sq"].detach().reshape(-1).clone()
            if not fp32:  # fp32: the main param is the model param, already written with the model
                piece["main"] = main.detach().reshape(-1).clone()
            params[name] = piece
    return {"params": params, "scalers": scalers}


# ---- reading a saved checkpoint into another layout ----------------------------------------------------------------
class SavedShards:
    """A format-2 checkpoint read by one rank of (possibly) another layout. `load_payload(ckpt_dir, rank)` reads a
    verified, memory-mapped rank file (trainer/checkpoints/checkpoint.py)."""

    def __init__(self, ckpt_dir: str | Path, meta: dict, spec, load_payload):
        self.dir, self.meta, self.spec = Path(ckpt_dir), meta, spec
        self.owners = Owners(meta["layouts"], 0)
        self.stage_layers = meta.get("pp_layers") or [[0, 1 << 30]]  # older checkpoints: one stage
        self._load, self._payloads = load_payload, {}
        self._keys: dict[int, dict] = {}  # saved rank -> {param_key: saved name}, for names other layers gave

    def payload(self, rank: int) -> dict:
        if rank not in self._payloads:
            self._payloads[rank] = self._load(self.dir, rank)
        return self._payloads[rank]

    # -- where a target tensor lives in the saved layout
    def _expert_source(self, name: str, ep_rank: int) -> tuple[str, int]:
        """Target (name, ep_rank) of an expert tensor -> its saved (name, ep_rank)."""
        saved_ep, ep = self.meta["ep"], self.spec.ep
        if saved_ep == ep:
            return name, ep_rank
        index = local_expert(name)
        if index is None:
            raise ValueError(f"{name}: an expert tensor without a local expert index cannot be moved across EP sizes")
        glob = ep_rank * (self.spec.num_experts // ep) + index
        per_saved = self.spec.num_experts // saved_ep
        return with_local_expert(name, glob % per_saved), glob // per_saved

    def _owner(self, name: str, tp_rank: int, ep_rank: int) -> int:
        stage = saved_stage(name, self.stage_layers)
        return (self.owners.expert_owner(ep_rank, 0, stage) if is_expert(name)
                else self.owners.dense_owner(tp_rank, stage))

    def _saved_name(self, name: str, owner: int) -> str:
        """The name saved rank `owner` gave the tensor this trainer names `name`: the same name, or under other
        layers the one of the same tensor (param_names.param_key); `name` itself when none is found (then the
        caller's lookup names it missing)."""
        from gspo_ray.trainer.weights.bridge import is_lora_param
        from gspo_ray.trainer.weights.param_names import param_key

        model = self.payload(owner)["model"]
        if name in model or is_lora_param(name) or name.endswith(EXTRA_STATE):
            return name
        if owner not in self._keys:
            self._keys[owner] = {param_key(n, self.spec.arch): n for n, v in model.items()
                                 if isinstance(v, Tensor) and not n.endswith(EXTRA_STATE) and not is_lora_param(n)}
        try:
            key = param_key(name, self.spec.arch)
        except KeyError:
            return name
        return self._keys[owner].get(key, name)

    def _saved_model(self, name: str, tp_rank: int, ep_rank: int):
        owner = self._owner(name, tp_rank, ep_rank)
        model, saved = self.payload(owner)["model"], self._saved_name(name, owner)
        if saved not in model:
            raise MissingShardError(f"{self.dir}: {name} is missing from rank_{owner}.pt")
        return model[saved]

    def _saved_slices(self, key: str, name: str, tp_rank: int, ep_rank: int):
        """[(start, flat tensor)] of `key` (exp_avg, exp_avg_sq, main, step) of `name` in its saved DP group."""
        out = []
        name = self._saved_name(name, self._owner(name, tp_rank, ep_rank))
        for r in self.owners.holders(name, tp_rank, ep_rank, saved_stage(name, self.stage_layers)):
            piece = self.payload(r)["optimizer"]["params"].get(name)
            if piece is not None:
                out.append((piece, piece.get(key)))
        return out

    def _saved_opt(self, key: str, name: str, tp_rank: int, ep_rank: int, lo: int = 0, hi: int | None = None):
        """Elements [lo, hi) of the flattened saved local tensor `key` of `name` (None: no state saved)."""
        slices = self._saved_slices(key, name, tp_rank, ep_rank)
        if not slices:
            return None
        if key == "main" and slices[0][1] is None:  # fp32 run: the main param is the model param
            return self._saved_model(name, tp_rank, ep_rank).reshape(-1)[lo:hi].float().clone()
        numel = int(torch.Size(slices[0][0]["shape"]).numel())
        hi = numel if hi is None else hi
        out, covered = torch.empty(hi - lo, dtype=slices[0][1].dtype), 0
        for piece, flat in slices:
            a, b = max(lo, piece["start"]), min(hi, piece["start"] + flat.numel())
            if a < b:
                out[a - lo:b - lo] = flat[a - piece["start"]:b - piece["start"]]
                covered += b - a
        if covered != hi - lo:
            raise MissingShardError(f"{self.dir}: the saved slices of {key} of {name} cover {covered} of "
                                    f"{hi - lo} elements (a rank file missing or from another save)")
        return out

    def _target(self, fetch, name: str, layout: dict, shape) -> Tensor:
        """The tensor `fetch(saved_name, tp_rank, ep_rank) -> saved local tensor` gives, in this rank's layout."""
        from gspo_ray.trainer.weights.bridge import shard_tp, unshard_tp

        if is_expert(name):
            saved_name, ep_rank = self._expert_source(name, layout["ep_rank"])
            return fetch(saved_name, 0, ep_rank)
        if self.meta["tp"] == self.spec.tp:
            return fetch(name, layout["tp_rank"], 0)
        try:
            pm = tp_map(name, self.spec.arch)
        except KeyError:
            raise ValueError(f"checkpoint {self.dir} was written with tp={self.meta['tp']}, this trainer has "
                             f"tp={self.spec.tp}: {name} cannot be resharded over TP") from None
        shards = [fetch(name, r, 0) for r in range(self.meta["tp"])]
        if any(s is None for s in shards):
            return None
        if pm.shard == "vocab":  # keep the padding rows (their state too), then pad or cut to this TP's padding
            full = torch.cat(shards, 0)
            rows = self.spec.padded_vocab_size
            full = (torch.nn.functional.pad(full, (0, 0, 0, rows - full.shape[0])) if rows > full.shape[0]
                    else full[:rows])
            return full.chunk(self.spec.tp, 0)[layout["tp_rank"]].contiguous()
        return shard_tp(unshard_tp(shards, pm, self.spec), pm, self.spec, self.spec.tp, layout["tp_rank"]).contiguous()

    def same_layout(self) -> bool:
        return self.meta["tp"] == self.spec.tp and self.meta["ep"] == self.spec.ep

    # -- public
    def model_state(self, layout: dict, reference: dict) -> dict:
        """This rank's model state dict (the keys and shapes of `reference`, its own current state dict)."""
        out = {}
        for name, ref in reference.items():
            if name.endswith(EXTRA_STATE) or not isinstance(ref, Tensor):
                out[name] = self._extra_state(name, layout, ref)
                continue
            t = self._target(self._saved_model, name, layout, ref.shape)
            if t.shape != ref.shape:
                raise ValueError(f"checkpoint {self.dir}: {name} has shape {tuple(t.shape)} in this layout, the model "
                                 f"{tuple(ref.shape)}")
            out[name] = t
        return out

    @torch.no_grad()
    def load_optimizer(self, optimizer, names: dict[int, str], layout: dict, fp32: bool) -> int:
        """Put the saved optimizer state, resharded, into this rank's optimizer; returns how many params got state.
        Everything is read (and a missing slice raised) before the optimizer is touched: never a partial load."""
        updates, scaler_updates = [], []
        # the sub-optimizers (dense, experts) need not match the saved ones: at EP 1 / DP 1 Megatron builds one
        scalers = self.payload(0)["optimizer"]["scalers"]
        for i, sub in enumerate(sub_optimizers(optimizer)):
            scaler = scalers[i] if i < len(scalers) else None
            for model_param, main, start in param_slots(sub):
                name, n = names[id(model_param)], main.numel()
                shape = model_param.shape
                if self.same_layout():  # only the overlapping saved slices are read
                    def get(key, name=name, start=start, n=n):
                        return self._saved_opt(key, name, layout["tp_rank"] if not is_expert(name) else 0,
                                               self._expert_source(name, layout["ep_rank"])[1]
                                               if is_expert(name) else 0, start, start + n)
                else:  # the whole local tensor rebuilt in this layout, then this rank's slice of it
                    def get(key, name=name, start=start, n=n, shape=shape):
                        full = self.tensor(key, name, layout, shape)
                        return None if full is None else full.reshape(-1)[start:start + n]
                exp_avg = get("exp_avg")
                if exp_avg is None:
                    continue  # nothing saved (no step taken yet): the optimizer starts fresh for it
                step = self._saved_slices("step", *self._saved_key(name, layout))[0][1]
                state = {"step": step.clone(), "exp_avg": exp_avg.view_as(main).clone(),
                         "exp_avg_sq": get("exp_avg_sq").view_as(main).clone()}
                updates.append((sub, main, state, None if fp32 else get("main").view_as(main).clone()))
            if scaler is not None and getattr(sub, "grad_scaler", None):
                scaler_updates.append((sub, scaler))
        for sub, main, state, value in updates:
            sub.optimizer.state[main] = state
            if value is not None:
                main.copy_(value)
        for sub, scaler in scaler_updates:
            sub.grad_scaler.load_state_dict(scaler)
        return len(updates)

    def tensor(self, key: str, name: str, layout: dict, shape) -> Tensor | None:
        """One tensor of this rank's layout: key "model", or an optimizer key (exp_avg, exp_avg_sq, main; None when
        no state was saved), whole (not this rank's DP slice)."""
        if key == "model":
            return self._target(self._saved_model, name, layout, shape)
        return self._target(lambda nm, t, e: self._full_opt(key, nm, t, e), name, layout, shape)

    def _extra_state(self, name: str, layout: dict, ref):
        """A module's extra state (see the module doc): as saved where this rank's module is the saved one and the
        saved value is of the same kind (a tensor under TE, None under the local layers), else `ref`, this
        trainer's own."""
        coordinate = "ep" if is_expert(name) else "tp"
        if self.meta[coordinate] != getattr(self.spec, coordinate):
            return ref  # another shard of the module: its FP8 scaling state does not apply
        owner = self._owner(name, layout["tp_rank"], layout["ep_rank"])
        saved = self.payload(owner)["model"].get(name, ref)
        return saved if isinstance(saved, Tensor) == isinstance(ref, Tensor) else ref

    def _saved_key(self, name: str, layout: dict) -> tuple[str, int, int]:
        if is_expert(name):
            saved, ep_rank = self._expert_source(name, layout["ep_rank"])
            return saved, 0, ep_rank
        return name, (layout["tp_rank"] if self.meta["tp"] == self.spec.tp else 0), 0

    def _full_opt(self, key: str, name: str, tp_rank: int, ep_rank: int):
        flat = self._saved_opt(key, name, tp_rank, ep_rank)
        if flat is None:
            return None
        shape = self._saved_slices(key, name, tp_rank, ep_rank)[0][0]["shape"]
        return flat.view(shape)


def tp_map(name: str, arch: str | None):
    """The bridge.ParamMap that says how TP splits a saved tensor: a base parameter's, or an adapter factor's
    (lora.adapters.adapter_tp_split; merged as a copy). KeyError for a name of neither."""
    from gspo_ray.trainer.weights.bridge import ParamMap, is_lora_param, param_map
    from gspo_ray.trainer.lora.adapters import adapter_tp_split

    if is_lora_param(name):
        return ParamMap((), "copy", adapter_tp_split(name))
    return param_map(name, arch)


def full_state(ckpt_dir: str | Path, model_dir: str | Path, load_payload,
               keys: tuple[str, ...] = ("model", "exp_avg", "exp_avg_sq")) -> dict[str, dict[str, Tensor | None]]:
    """{Megatron name at TP 1 / EP 1: {key: tensor}} of a format-2 checkpoint: the whole model and optimizer state
    in one layout, whatever layout wrote it (to compare two checkpoints; small models only)."""
    from gspo_ray.trainer.checkpoints.checkpoint import read_meta
    from gspo_ray.trainer.model_spec import read_hf_config, spec_from_hf_config

    meta = read_meta(ckpt_dir)
    spec = spec_from_hf_config(read_hf_config(model_dir), str(model_dir), tp=1, ep=1)
    saved = SavedShards(ckpt_dir, meta, spec, load_payload)
    lay = dict(rank=0, tp_rank=0, ep_rank=0, etp_rank=0, pp_rank=0)
    names = []
    for stage in range(len(saved.stage_layers)):  # global names: each stage's own
        names += [n for n, v in saved.payload(saved.owners.dense_owner(0, stage))["model"].items()
                  if isinstance(v, Tensor) and not is_expert(n) and not n.endswith(EXTRA_STATE)]
        for e in range(meta["ep"]):  # expert j of saved EP rank e is expert e * local + j at EP 1
            local = spec.num_experts // meta["ep"] if spec.num_experts else 0
            for n, v in saved.payload(saved.owners.expert_owner(e, 0, stage))["model"].items():
                j = local_expert(n)
                if isinstance(v, Tensor) and is_expert(n) and j is not None:
                    names.append(with_local_expert(n, e * local + j))
    return {n: {k: saved.tensor(k, n, lay, None) for k in keys} for n in names}
