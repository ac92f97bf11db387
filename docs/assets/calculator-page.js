// The memory calculator's page (docs/calculator.md): read the form, run estimate() from
// calculator.js, and show the result as tables and a stacked bar (SVG). Every number
// cell carries its exact bytes in data-bytes, which tests/site/test_site_browser.py reads.
(function () {
  "use strict";
  const calc = window.tinyscaleCalculator;
  const form = document.getElementById("calc-form");
  if (!form || !calc) return;

  const SVG = "http://www.w3.org/2000/svg";
  const CATEGORIES = [  // [key, label, colour]
    ["parameters", "parameters", "#3f51b5"],
    ["gradients", "gradients", "#26a69a"],
    ["master_weights", "fp32 master weights", "#ffb300"],
    ["optimizer_states", "optimizer states", "#ef6c00"],
    ["activations", "activations", "#8e24aa"],
  ];
  const PLACES = [["device", "GPU"], ["host", "host (CPU) memory"], ["disk", "disk (NVMe)"]];
  const COMM = [  // [key, what]: each checked against the engine's ledger (tests/memory/test_calculator_measured.py)
    ["dp", "data parallel / ZeRO over dp × cp ranks (ring collectives)"],
    ["tp", "tensor parallel: 4 all-reduces per block per micro-batch (6 with full recompute); " +
      "the embedding's, the head's and the loss's not counted"],
    ["pp", "pipeline parallel: the busiest stage's activations forward and gradients back"],
    ["cp", "context parallel: ring attention's K, V hops (dK, dV in fp32)"],
  ];
  const PLANNED = "formula only, not checked against a measurement yet";  // calculator.PLANNED: pp's activations

  function readInputs() {
    const inputs = {};
    for (const el of form.querySelectorAll("[name]")) {
      if (el.type === "checkbox") inputs[el.name] = el.checked;
      else if (el.type === "number") {
        const text = el.value.trim();
        if (text === "") inputs[el.name] = null;  // optional shape: the model's own rule
        else inputs[el.name] = Number(text);
      } else if (el.dataset.type === "int") inputs[el.name] = Number(el.value);
      else inputs[el.name] = el.value;
    }
    if (inputs.model !== "custom") {
      for (const el of form.querySelectorAll("#calc-custom [name]")) delete inputs[el.name];
    }
    return inputs;
  }

  function human(bytes) {
    if (bytes === 0) return "0";
    const units = [["TB", 1e12], ["GB", 1e9], ["MB", 1e6], ["KB", 1e3]];
    for (const [unit, size] of units) {
      if (bytes >= size) return `${(bytes / size).toPrecision(3)} ${unit}`;
    }
    return `${bytes.toPrecision(3)} B`;
  }

  function cell(row, bytes, key) {
    const td = row.insertCell();
    td.textContent = human(bytes);
    td.dataset.key = key;
    td.dataset.bytes = String(bytes);
    td.title = `${bytes.toLocaleString("en")} bytes`;
    return td;
  }

  function memoryTable(out) {
    const table = document.getElementById("calc-memory");
    table.innerHTML = "";
    const places = PLACES.filter(([loc]) => loc === "device" || out[loc].total > 0);
    const head = table.createTHead().insertRow();
    for (const text of ["per rank", ...places.map(([, label]) => label)]) {
      head.appendChild(document.createElement("th")).textContent = text;
    }
    const body = table.createTBody();
    for (const [key, label] of [...CATEGORIES, ["total", "total"]]) {
      const row = body.insertRow();
      row.insertCell().textContent = label;
      for (const [loc] of places) cell(row, out[loc][key], `${loc}.${key}`);
    }
  }

  function commTable(out) {
    const table = document.getElementById("calc-comm");
    table.innerHTML = "";
    const head = table.createTHead().insertRow();
    for (const text of ["parallelism", "bytes sent per rank per step", "what"]) {
      head.appendChild(document.createElement("th")).textContent = text;
    }
    const body = table.createTBody();
    for (const [key, what] of [...COMM, ["total", ""]]) {
      const row = body.insertRow();
      row.insertCell().textContent = key;
      cell(row, out.comm[key], `comm.${key}`);
      row.insertCell().textContent = what;
    }
  }

  function svg(tag, attrs, parent) {
    const el = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
    if (parent) parent.appendChild(el);
    return el;
  }

  // One horizontal stacked bar per place that holds anything, on one GB scale, with the
  // GPU's capacity drawn as a dashed line.
  function stackedBars(out, capacityGB) {
    const box = document.getElementById("calc-bar");
    box.innerHTML = "";
    const places = PLACES.filter(([loc]) => loc === "device" || out[loc].total > 0);
    const W = 720, left = 130, right = 20, barH = 34, gap = 16, top = 10;
    const H = top + places.length * (barH + gap) + 60;
    const root = svg("svg", {viewBox: `0 0 ${W} ${H}`, role: "img", width: "100%",
                             "aria-label": "per-rank memory by category"}, box);
    // Scale to the largest bar; include the GPU's capacity unless it would squash the bars.
    const largest = Math.max(...places.map(([loc]) => out[loc].total), 1);
    const showCapacity = capacityGB > 0 && capacityGB * 1e9 <= 4 * largest;
    const maxBytes = showCapacity ? Math.max(capacityGB * 1e9, largest) * 1.05 : largest * 1.15;
    const scale = (W - left - right) / maxBytes;
    places.forEach(([loc, label], i) => {
      const y = top + i * (barH + gap);
      svg("text", {x: left - 8, y: y + barH / 2 + 5, "text-anchor": "end", class: "calc-label"}, root)
        .textContent = label;
      let x = left;
      for (const [key, name, colour] of CATEGORIES) {
        const bytes = out[loc][key];
        if (bytes <= 0) continue;
        const rect = svg("rect", {x, y, width: Math.max(bytes * scale, 0.5), height: barH, fill: colour,
                                  "data-key": `${loc}.${key}`}, root);
        svg("title", {}, rect).textContent = `${name}: ${human(bytes)}`;
        x += bytes * scale;
      }
      svg("text", {x: Math.min(x + 6, W - right - 60), y: y + barH / 2 + 5, class: "calc-label"}, root)
        .textContent = human(out[loc].total);
    });
    const axisY = top + places.length * (barH + gap);
    if (showCapacity) {
      const cx = left + capacityGB * 1e9 * scale;
      svg("line", {x1: cx, x2: cx, y1: top - 4, y2: axisY - gap + 4, class: "calc-capacity"}, root);
      svg("text", {x: cx, y: axisY + 4, "text-anchor": "end", class: "calc-label"}, root)
        .textContent = `GPU: ${capacityGB} GB`;
    } else if (capacityGB > 0) {
      svg("text", {x: W - right, y: axisY + 4, "text-anchor": "end", class: "calc-label"}, root)
        .textContent = `GPU: ${capacityGB} GB, off this scale →`;
    }
    // legend
    let lx = left;
    for (const [, name, colour] of CATEGORIES) {
      svg("rect", {x: lx, y: axisY + 20, width: 12, height: 12, fill: colour}, root);
      const t = svg("text", {x: lx + 16, y: axisY + 31, class: "calc-label"}, root);
      t.textContent = name;
      lx += 28 + name.length * 7.2;
    }
  }

  function render() {
    const custom = form.elements.model.value === "custom";
    document.getElementById("calc-custom").hidden = !custom;
    const error = document.getElementById("calc-error");
    const x = readInputs();
    let out;
    try {
      out = calc.estimate(x);
    } catch (e) {
      error.textContent = `Not a possible layout: ${e.message}`;
      error.hidden = false;
      document.getElementById("calc-results").hidden = true;
      return;
    }
    error.hidden = true;
    document.getElementById("calc-results").hidden = false;
    const params = document.getElementById("calc-params");
    params.dataset.bytes = String(out.num_params);
    params.textContent = `Ψ = ${out.num_params.toLocaleString("en")} parameters; ` +
      `${Math.round(out.params_per_rank).toLocaleString("en")} per rank (Ψ / (tp · pp)), ` +
      `ZeRO shards over N_d = dp · cp = ${x.dp * x.cp} ranks.`;
    const note = document.getElementById("calc-planned-note");
    note.hidden = !(x.pp > 1);
    note.textContent = `pp > 1: the activations' pp factors (⌈L / pp⌉ layers, min(pp, m) micro-batches ` +
      `in flight on 1F1B's first stage) are ${PLANNED}.`;
    const capacity = Number(document.getElementById("calc-capacity").value) || 0;
    const fits = document.getElementById("calc-fits");
    fits.textContent = capacity > 0 ? (out.device.total <= capacity * 1e9
      ? `Fits in ${capacity} GB (before buffers and fragmentation).`
      : `Does not fit in ${capacity} GB.`) : "";
    memoryTable(out);
    stackedBars(out, capacity);
    commTable(out);
  }

  form.addEventListener("input", render);
  form.addEventListener("change", render);
  render();
})();
