// The memory calculator's arithmetic: a line-by-line port of src/tinyscale/calculator.py
// (which composes tinyscale.zero.estimate, tinyscale.checkpointing.formula and, under cp, the
// planner's layer_activation_bytes). Pure: no DOM.
// `pytest -k calculator` checks that estimate(inputs) here equals the Python one for a grid
// of inputs, in node and in the built page. Change both files together.
//
//   node -e 'console.log(require("./docs/assets/calculator.js").estimate({model: "llama-1b"}))'
(function (root) {
  "use strict";

  // tinyscale.models.config.PRESETS (a test checks they are the same shapes)
  const PRESETS = {
    "tiny": {vocab_size: 256, max_seq_len: 32, n_layer: 2, n_head: 4, n_kv_head: 2, d_model: 32},
    "small": {vocab_size: 256, max_seq_len: 128, n_layer: 4, n_head: 4, d_model: 128},
    "gpt2-124m": {vocab_size: 50257, max_seq_len: 1024, n_layer: 12, n_head: 12, d_model: 768,
                  ffn_hidden: 2048, tie_embeddings: true},
    "llama-1b": {vocab_size: 128256, max_seq_len: 8192, n_layer: 16, n_head: 32, n_kv_head: 8,
                 d_model: 2048, ffn_hidden: 8192, rope_theta: 500000.0, tie_embeddings: true},
  };
  const GPT_DEFAULTS = {vocab_size: 256, max_seq_len: 128, n_layer: 2, n_head: 4, n_kv_head: null,
                        d_model: 64, ffn_hidden: null, multiple_of: 16, tie_embeddings: false,
                        dropout: 0.0, attn_impl: "sdpa", rope_theta: 10000.0};
  const SHAPE_FIELDS = ["vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "ffn_hidden",
                        "tie_embeddings", "dropout", "attn_impl"];
  const DTYPE_BYTES = {bf16: 2, fp16: 2, fp32: 4};
  const STATES_PER_PARAM = {adamw: 2, sgd_momentum: 1, sgd: 0};  // momentum, variance
  const DKV_BYTES = 4;  // ring attention passes its dK/dV accumulators in at least float32 (context_parallel/ring.py)
  const POLICIES = ["none", "full", "selective", "offload"];
  const OFFLOAD_TARGETS = ["none", "cpu", "nvme"];
  const WHERE = {none: "device", cpu: "host", nvme: "disk"};
  const CATEGORIES = ["parameters", "gradients", "master_weights", "optimizer_states"];
  const LOCATIONS = ["device", "host", "disk"];
  const DEFAULTS = {model: "gpt2-124m", dtype: "bf16", optimizer: "adamw", dp: 8, tp: 1, pp: 1, cp: 1,
                    zero_stage: 1, offload: "none", offload_params: "none", micro_batch: 4,
                    seq_len: 1024, num_microbatches: 1, checkpointing: "none"};

  const isInt = (v) => typeof v === "number" && Number.isInteger(v);
  const fail = (msg) => { throw new Error(msg); };

  // GPTConfig: its checks, kv_dim, ffn_dim and num_params
  function gptConfig(shape) {
    const c = Object.assign({}, GPT_DEFAULTS, shape);
    for (const f of ["vocab_size", "max_seq_len", "n_layer", "n_head", "d_model", "multiple_of"]) {
      if (!isInt(c[f]) || c[f] <= 0) fail(`${f}=${c[f]}: it must be a positive int`);
    }
    for (const f of ["n_kv_head", "ffn_hidden"]) {
      if (c[f] !== null && (!isInt(c[f]) || c[f] <= 0)) fail(`${f}=${c[f]}: it must be empty or a positive int`);
    }
    if (c.d_model % c.n_head) fail(`d_model=${c.d_model}: it must be a multiple of n_head=${c.n_head}`);
    c.kv_heads = c.n_kv_head === null ? c.n_head : c.n_kv_head;
    if (c.n_head % c.kv_heads) fail(`n_kv_head=${c.n_kv_head}: it must divide n_head=${c.n_head}`);
    c.head_dim = c.d_model / c.n_head;
    if (c.head_dim % 2) fail(`d_model=${c.d_model}: head_dim = d_model / n_head = ${c.head_dim} must be even (RoPE)`);
    if (!(c.dropout >= 0 && c.dropout < 1)) fail(`dropout=${c.dropout}: it must satisfy 0 <= dropout < 1`);
    if (c.attn_impl !== "sdpa" && c.attn_impl !== "math") fail(`attn_impl=${c.attn_impl}: use sdpa or math`);
    c.kv_dim = c.kv_heads * c.head_dim;
    c.ffn_dim = c.ffn_hidden !== null ? c.ffn_hidden
      : Math.ceil(Math.trunc(8 * c.d_model / 3) / c.multiple_of) * c.multiple_of;
    return c;
  }

  function numParams(c) {
    const C = c.d_model, V = c.vocab_size;
    const attn = 2 * C * C + 2 * C * c.kv_dim;
    const mlp = 3 * C * c.ffn_dim;
    let total = c.n_layer * (attn + mlp + 2 * C) + C;
    total += c.tie_embeddings ? 0 : V * C;
    return total + V * C;
  }

  // tinyscale.checkpointing.formula.block_saved_bytes (u: upcast_bytes, the float32-at-least dtype)
  function blockSavedBytes(c, batch, seq, p, policy) {
    const s = seq, b = batch, h = c.d_model, a = c.n_head, F = c.ffn_dim, kv = c.kv_dim;
    const d = c.dropout > 0 ? 1 : 0;
    const u = Math.max(p, 4);
    const norms = u * (2 * s * b * h + 2 * s * b) + p * 2 * s * b * h;
    const mlp = p * 4 * s * b * F;
    if (policy === "full") return p * s * b * h;
    if (policy === "offload") return 0;
    if (policy === "selective") return norms + p * ((4 + 2 * d) * s * b * h + 2 * s * b * kv) + mlp;
    const outs = p * (3 + 2 * d) * s * b * h;
    const qkv = 3 * s * b * h;
    if (c.attn_impl === "sdpa" && d === 0) return norms + outs + p * qkv + mlp + u * a * s * b;
    if (c.attn_impl === "sdpa") return norms + outs + u * (qkv + 3 * a * s * s * b) + mlp;
    const probs = d ? 2 * d : (p < u ? 1 : 0);
    const core = (u + p * probs) * a * s * s * b;
    return norms + outs + p * qkv + mlp + core + s * s;
  }

  // tinyscale.planner.estimate.layer_activation_bytes (dense, sp): one block per rank under cp > 1
  function layerActivationBytes(c, batch, seq, p, policy, tp, cp) {
    const s = seq / cp, b = batch, h = c.d_model, F = c.ffn_dim, kv = c.kv_dim, a = c.n_head;
    const u = Math.max(p, 4);
    let norms = u * (2 * s * b * h + 2 * s * b) + p * 2 * s * b * h;
    if (c.dropout > 0 && cp > 1) norms += p * 2 * s * b * h;  // the two residual dropout masks
    const gathered = p * 2 * s * b * h;
    if (policy === "full") return p * s * b * h / tp;
    if (policy === "offload") return 0.0;
    let split;
    if (policy === "selective") split = p * (2 * s * b * h + 2 * s * b * kv + 4 * s * b * F);
    else if (cp > 1) {  // ring attention: q, k and v unrepeated, its output in u, wo's input
      split = p * (2 * s * b * h + 2 * s * b * kv + 4 * s * b * F) + u * (s * b * h + a * s * b);
    }
    else split = p * (4 * s * b * h + 4 * s * b * F) + u * a * s * b;
    return norms / tp + gathered + split / tp;
  }

  // tinyscale.zero.estimate: _placement, model_state_bytes, comm_volume, comm_bytes_per_rank
  function modelStateBytes(numParams, dp, stage, offload, offloadParams, nb) {
    if (![0, 1, 2, 3].includes(stage)) fail(`zero_stage=${stage}: ZeRO stages are 0 (DDP), 1, 2 and 3`);
    for (const [name, v] of [["offload", offload], ["offload_params", offloadParams]]) {
      if (!OFFLOAD_TARGETS.includes(v)) fail(`${name}=${v}: use one of ${OFFLOAD_TARGETS.join(", ")}`);
    }
    if (offload !== "none" && stage < 2) fail(`offload=${offload} needs ZeRO stage 2 or 3, got stage ${stage}`);
    if (offloadParams !== "none" && stage !== 3) fail(`offload_params=${offloadParams} needs ZeRO stage 3, got stage ${stage}`);
    const placement = [
      ["parameters", nb.param_bytes, stage >= 3, WHERE[offloadParams]],
      ["gradients", nb.grad_bytes, stage >= 2, offload === "none" ? "device" : "host"],
      ["optimizer", nb.optimizer_bytes, stage >= 1, WHERE[offload]],
    ];
    const places = {};
    for (const loc of LOCATIONS) places[loc] = Object.fromEntries(CATEGORIES.map((k) => [k, 0.0]));
    for (const [what, perElement, sharded, where] of placement) {
      const elements = sharded ? numParams / dp : numParams;
      if (what === "optimizer") {
        places[where].master_weights = nb.master_bytes * elements;
        places[where].optimizer_states = (perElement - nb.master_bytes) * elements;
      } else {
        places[where][what] = perElement * elements;
      }
    }
    return places;
  }

  function commBytesPerRank(numParams, stage, dp, bytesPerElement, m) {
    const collectives = {0: 2, 1: 2, 2: m + 1, 3: 3 * m}[stage];
    const volume = collectives * numParams;
    return volume * (dp - 1) / dp * bytesPerElement;
  }

  function bytesPerElement(dtype, optimizer, stage) {
    const states = 4 * STATES_PER_PARAM[optimizer];
    if (dtype === "fp32") {  // ZeRO >= 1 steps an fp32 copy of the rank's shard; DDP none
      const master = [1, 2, 3].includes(stage) ? 4 : 0;
      return {param_bytes: 4, grad_bytes: 4, optimizer_bytes: master + states, master_bytes: master};
    }
    return {param_bytes: 2, grad_bytes: 2, optimizer_bytes: 4 + states, master_bytes: 4};
  }

  const add = (values) => values.reduce((total, v) => total + v, 0.0);

  // tinyscale.calculator.estimate
  function estimate(inputs) {
    const x = Object.assign({}, DEFAULTS, inputs);
    for (const [field, allowed] of [["dtype", Object.keys(DTYPE_BYTES)],
      ["optimizer", Object.keys(STATES_PER_PARAM)], ["checkpointing", POLICIES]]) {
      if (!allowed.includes(x[field])) fail(`${field}=${x[field]}: use one of ${allowed.join(", ")}`);
    }
    for (const f of ["dp", "tp", "pp", "cp", "micro_batch", "seq_len", "num_microbatches"]) {
      if (!isInt(x[f]) || x[f] < 1) fail(`${f}=${x[f]}: give an int >= 1`);
    }
    const {dp, tp, pp, cp, micro_batch: b, seq_len: s, num_microbatches: m} = x;
    let c;
    if (x.model === "custom") {
      const shape = {max_seq_len: Math.max(1, s)};
      for (const k of SHAPE_FIELDS) if (x[k] !== undefined && x[k] !== null) shape[k] = x[k];
      c = gptConfig(shape);
    } else if (PRESETS[x.model]) {
      c = gptConfig(PRESETS[x.model]);
    } else {
      fail(`unknown GPT preset ${x.model}: choose one of ${Object.keys(PRESETS).join(", ")} or custom`);
    }
    if (c.n_head % tp || c.kv_heads % tp) fail(`tp=${tp}: it must divide n_head=${c.n_head} and the K/V heads=${c.kv_heads}`);
    if (pp > c.n_layer) fail(`pp=${pp}: at most n_layer=${c.n_layer} stages (one layer each)`);
    if (s % cp) fail(`cp=${cp}: it must divide seq_len=${s} (each cp rank takes s/cp tokens)`);
    const nParams = numParams(c);
    const nb = bytesPerElement(x.dtype, x.optimizer, x.zero_stage);
    const states = modelStateBytes(nParams / (tp * pp), dp * cp, x.zero_stage, x.offload, x.offload_params, nb);
    const policy = x.checkpointing, p = DTYPE_BYTES[x.dtype];
    const gathered = 2 * s * b * c.d_model * p;  // the norms' outputs: saved all-gathered, whole on each tp rank
    const splitNorms = ["none", "selective"].includes(policy);  // the policies that save the norms' outputs
    const kept = blockSavedBytes(c, b, s, p, policy) + (tp - 1) * (splitNorms ? gathered : 0);
    const full = blockSavedBytes(c, b, s, p, "none") + (tp - 1) * gathered;
    const layers = Math.ceil(c.n_layer / pp);
    const inFlight = pp === 1 ? 1 : Math.min(pp, m);
    let activations;
    if (cp === 1) {
      activations = (layers * inFlight * kept + (full - kept)) / tp;
    } else {  // ring attention's block, per rank (k, v unrepeated, its float32 output): the planner's count
      const keptRank = layerActivationBytes(c, b, s, p, policy, tp, cp);
      const fullRank = layerActivationBytes(c, b, s, p, "none", tp, cp);
      activations = layers * inFlight * keptRank + (fullRank - keptRank);
    }
    const out = {num_params: nParams, params_per_rank: nParams / (tp * pp)};
    for (const loc of LOCATIONS) {
      const row = Object.assign({}, states[loc], {activations: loc === "device" ? activations : 0.0});
      row.total = add(Object.values(row));
      out[loc] = row;
    }
    const tokens = s / cp * b;
    const recompute = policy === "full";
    const comm = {
      dp: commBytesPerRank(nParams / (tp * pp), x.zero_stage, dp * cp, nb.grad_bytes, m),
      tp: ((recompute ? 6 : 4) * layers + (pp === 1 ? 2 : 1)) * 2 * (tp - 1) / tp * tokens * c.d_model * p * m,
      pp: pp === 1 ? 0.0 : Math.min(pp - 1, 2) * tokens * c.d_model * p * m,
      cp: ((recompute ? 6 : 4) * p + 2 * DKV_BYTES) * (cp - 1) * tokens * c.kv_dim / tp * layers * m,
    };
    comm.total = add(Object.values(comm));
    out.comm = comm;
    return out;
  }

  const api = {estimate, PRESETS, DEFAULTS, POLICIES, OFFLOAD_TARGETS, gptConfig, numParams};
  if (typeof module !== "undefined" && module.exports) module.exports = api;
  else root.tinyscaleCalculator = api;
})(this);
