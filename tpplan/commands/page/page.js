"use strict";
// Draws a tpplan page from the JSON inlined in <script id="data">: the same object that
// `tpplan validate --json` (or `tpplan report --json`) prints. No network, no library.
(function () {
  const errorBox = document.getElementById("js-errors");
  function report(message) {
    errorBox.hidden = false;
    errorBox.textContent += message + "\n";
  }
  window.addEventListener("error", (e) => report("error: " + e.message));
  window.addEventListener("unhandledrejection", (e) => report("unhandled: " + e.reason));

  const PART_COLORS = {
    parameters: "#4e79a7", buffers: "#bab0ac", optimizer: "#f28e2b", gradients: "#e15759",
    fsdp_unsharded: "#76b7b2", accumulated_gradients: "#b07aa1", activations: "#59a14f",
    transients: "#edc948", allocator: "#d4a6a6", reserve: "#8f8f8f",
  };
  const PARTS = Object.keys(PART_COLORS).slice(0, 8);
  const PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#b07aa1",
                   "#9c755f", "#edc948", "#ff9da7", "#bab0ac", "#1f77b4", "#8c564b"];
  const DIMS = ["dp_replicate", "dp_shard", "tp"];
  const MAX_ROWS = 32;
  const SVG = "http://www.w3.org/2000/svg";

  function size(n) {  // bytes for people, as the terminal prints them
    if (n === null || n === undefined) return "-";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let v = n;
    for (let i = 0; i < units.length; i++) {
      if (Math.abs(v) < 1024 || i === units.length - 1)
        return i === 0 ? `${Math.round(v)} B` : `${v.toFixed(2)} ${units[i]}`;
      v /= 1024;
    }
  }
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") node.textContent = v;
      else if (k === "class") node.className = v;
      else node.setAttribute(k, v);
    }
    for (const c of children) if (c !== null && c !== undefined) node.append(c);
    return node;
  }
  function svg(tag, attrs, ...children) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") node.textContent = v; else node.setAttribute(k, v);
    }
    for (const c of children) node.append(c);
    return node;
  }
  function table(id, headers, rows) {  // rows: arrays of cells; a cell: text or {text, num, attrs}
    const head = el("tr", {}, ...headers.map((h) => el("th", { class: h.num ? "num" : "", text: h.text || h })));
    const body = rows.map((r) => el("tr", r.attrs || {}, ...r.cells.map((c) => {
      const cell = typeof c === "object" && c !== null ? c : { text: c };
      return el("td", { class: cell.num ? "num" : "", text: cell.text ?? "", ...(cell.attrs || {}) });
    })));
    return el("table", { id }, el("thead", {}, head), el("tbody", {}, ...body));
  }
  const num = (text, bytes) => ({ text, num: true, attrs: bytes === undefined ? {} : { "data-bytes": bytes } });
  const generalize = (path) => path.replace(/\.\d+(?=\.|$)/g, ".*");

  // ---- the plan ---------------------------------------------------------------------
  function renderPlan(d, root) {
    const s = d.step || {};
    root.append(el("div", { class: "facts", id: "facts" },
      fact("world size", d.world_size, "world_size"),
      fact("mesh", d.mesh ? DIMS.map((k) => `${k} ${d.mesh[k]}`).join(" × ") : "-", "mesh"),
      fact("step", s.seq_len ? `${s.global_batch_size} × ${s.seq_len} tokens, micro-batch ${s.micro_batch_size}, ${s.grad_accum} per step` : "-", "step"),
      fact("dtypes", s.param_dtype ? `${s.param_dtype} compute, ${s.reduce_dtype} reduce` : "-", "dtypes"),
      fact("status", d.ok ? "valid" : "not valid", "ok")));
    if (d.errors && d.errors.length) {
      root.append(el("h2", { text: "Errors in the plan" }),
        el("pre", { id: "plan-errors", text: d.errors.map((e) => `${e.file}:${e.line}:${e.column}: ${e.message}`).join("\n") }));
      return;
    }
    if (d.mesh) renderMesh(d.mesh, root);
    renderModules(d.modules || [], root);
    if (d.memory_per_rank) renderMemory(d.memory_per_rank, d.fit, root);
    if (d.comm_per_step) renderComm(d.comm_per_step, d.comm_minimum, d.modules || [], root);
    if (d.step_time) renderStepTime(d.step_time, root);
    if (d.analysis_errors && d.analysis_errors.length)
      root.append(el("h2", { text: "Analyses that could not run" }),
        el("pre", { id: "analysis-errors", text: d.analysis_errors.map((e) => `${e.analysis}: ${e.message}`).join("\n") }));
  }
  function fact(label, value, key) {
    return el("div", { "data-fact": key }, el("b", { text: label }), String(value));
  }

  function renderMesh(mesh, root) {
    const shape = DIMS.map((k) => mesh[k]);
    const [R, S, T] = shape;
    const rows = R * S, shown = Math.min(rows, MAX_ROWS);
    const grid = el("div", { class: "mesh" + (T > 16 || shown > 32 ? " small" : ""), id: "mesh",
      "data-shape": shape.join(","), "data-world": R * S * T });
    grid.style.gridTemplateColumns = `repeat(${T}, auto)`;
    for (let row = 0; row < shown; row++) {
      for (let t = 0; t < T; t++) {
        const rank = row * T + t;
        const coords = { dp_replicate: Math.floor(row / S), dp_shard: row % S, tp: t };
        const cell = el("div", { class: "rank", "data-rank": rank, title: `rank ${rank}: ` +
          DIMS.map((k) => `${k} ${coords[k]}`).join(", "), text: rank });
        for (const k of DIMS) cell.dataset[k] = coords[k];
        grid.append(cell);
      }
    }
    const legend = el("p", { class: "legend", id: "mesh-legend" });
    const buttons = el("div", { class: "buttons" }, ...DIMS.map((k) =>
      el("button", { "data-dim": k, text: `${k} groups (${mesh[k]} ranks each)` })));
    function colour(dim) {
      // Ranks that differ only along `dim` form one of its groups: they share a colour.
      const others = DIMS.filter((k) => k !== dim);
      for (const cell of grid.children) {
        const key = others.map((k) => cell.dataset[k]).join(",");
        const group = others.reduce((acc, k) => acc * mesh[k] + Number(cell.dataset[k]), 0);
        cell.dataset.group = group;
        cell.dataset.groupKey = key;
        cell.style.background = PALETTE[group % PALETTE.length];
      }
      for (const b of buttons.children) b.className = b.dataset.dim === dim ? "on" : "";
      legend.textContent = `Coloured by ${dim}: ranks of one colour form one ${dim} group ` +
        `(${mesh[dim]} ranks that ${dim === "tp" ? "split each layer's weights and run its collectives" :
        dim === "dp_shard" ? "shard parameters, gradients and optimizer state (FSDP2)" :
        "hold replicas and all-reduce gradients (HSDP)"}). Rank = (dp_replicate × dp_shard + ` +
        `dp_shard index) × tp + tp index.` + (rows > shown ? ` Showing the first ${shown} of ${rows} rows.` : "");
    }
    buttons.addEventListener("click", (e) => { if (e.target.dataset.dim) colour(e.target.dataset.dim); });
    root.append(el("h2", { text: `Mesh: ${R * S * T} ranks` }), buttons,
      el("div", { class: "mesh-wrap" }, grid, legend));
    colour(T > 1 ? "tp" : "dp_shard");
  }

  function renderModules(modules, root) {
    const groups = new Map();
    for (const m of modules) {
      const key = JSON.stringify([generalize(m.path), m.type, m.rule, m.style,
        m.params.map((p) => [p.name, p.global_shape, p.local_shape, p.placements])]);
      if (!groups.has(key)) groups.set(key, { path: generalize(m.path), row: m, count: 0 });
      groups.get(key).count++;
    }
    const rows = [];
    for (const g of groups.values()) {
      const params = g.row.params.length ? g.row.params : [null];
      params.forEach((p, i) => rows.push({
        attrs: i === 0 ? { "data-path": g.path, "data-count": g.count } : { "data-param-of": g.path },
        cells: [i ? "" : g.path, i ? "" : num(g.count), i ? "" : (g.row.rule || "-"),
          i ? "" : (g.row.style || "-"), p ? p.name : "", p ? `(${p.global_shape.join(", ")})` : "",
          p ? `(${p.local_shape.join(", ")})` : "", p ? p.placements : ""],
      }));
    }
    root.append(el("h2", { text: "Modules: rule, style, shapes and placements" }),
      el("div", { class: "scroll" }, table("modules", ["module", { text: "×", num: true }, "rule (file:line)",
        "style", "parameter", "global shape", "local shape (this rank)", "placements"], rows)));
  }

  function renderMemory(m, fit, root) {
    root.append(el("h2", { text: "Memory per rank" }));
    if (m.error) { root.append(el("p", { class: "bad", id: "memory-error", text: m.error })); return; }
    const b = m.batch;
    root.append(el("p", { class: "sub", text: `One optimizer step: micro-batch ${b.micro_batch_size} × seq ${b.seq_len}, ` +
      `${b.grad_accum} micro-batch(es), ${b.compute_dtype} compute, AdamW. Peak: ${m.peak_at}.` }));
    const bars = [{ label: "at the peak", id: "peak", parts: { ...m.at_peak }, total: m.peak },
                  { label: "each part at its largest", id: "largest", parts: Object.fromEntries(PARTS.map((p) => [p, m[p]])), total: m.total }];
    const keys = [...PARTS];
    if (fit) {  // what the device must hold beyond the peak, as assumed
      bars[0].parts.allocator = fit.needed - fit.peak - fit.assumptions.runtime_reserve;
      bars[0].parts.reserve = fit.assumptions.runtime_reserve;
      bars[0].label = "needs (peak + assumed)";
      bars[0].total = fit.needed;
      keys.push("allocator", "reserve");
    }
    const extra = fit ? fit.changes.filter((c) => c.needed !== null) : [];
    const scaleMax = Math.max(m.total, fit ? Math.max(fit.capacity, fit.needed, ...extra.map((c) => c.needed)) : 0);
    const W = 920, left = 250, barH = 22, gap = 10;
    const width = (v) => Math.max(0, (v / scaleMax) * (W - left - 20));
    const height = (bars.length + extra.length) * (barH + gap) + 40;
    const chart = svg("svg", { id: "memory", width: W, height, viewBox: `0 0 ${W} ${height}` });
    bars.forEach((bar, i) => {
      const y = 10 + i * (barH + gap);
      const group = svg("g", { "data-bar": bar.id, "data-total": bar.total });
      group.append(svg("text", { x: 0, y: y + 15, text: `${bar.label}: ${size(bar.total)}` }));
      let x = left;
      for (const p of keys) {
        if (bar.parts[p] === undefined) continue;
        const w = width(bar.parts[p] || 0);
        group.append(svg("rect", { x, y, width: w, height: barH, fill: PART_COLORS[p], class: "part",
          "data-part": p, "data-bytes": bar.parts[p] || 0 }, svg("title", { text: `${p}: ${size(bar.parts[p] || 0)}` })));
        x += w;
      }
      chart.append(group);
    });
    extra.forEach((c, j) => {
      const y = 10 + (bars.length + j) * (barH + gap);
      chart.append(svg("g", { "data-change": c.change, "data-needed": c.needed },
        svg("text", { x: 0, y: y + 15, text: `${c.change.slice(0, 38)}${c.change.length > 38 ? "…" : ""}: ${size(c.needed)}` }),
        svg("rect", { x: left, y, width: width(c.needed), height: barH, fill: c.fits ? "#1f8a4c" : "#c2410c", opacity: 0.8 })));
    });
    if (fit) {
      const x = left + width(fit.capacity);
      chart.append(svg("line", { class: "capacity", x1: x, x2: x, y1: 0, y2: height - 20, "data-capacity": fit.capacity }),
        svg("text", { x: Math.min(x + 4, W - 150), y: height - 6, text: `${fit.device.name}: ${size(fit.capacity)}` }));
    }
    root.append(chart, el("p", { class: "legend" }, ...keys.map((p) =>
      el("span", {}, el("span", { class: "swatch", style: `background:${PART_COLORS[p]}` }), p + "  "))));
    root.append(table("memory-table", ["part", { text: "largest", num: true }, { text: "at the peak", num: true }],
      PARTS.map((p) => ({ attrs: { "data-part": p }, cells: [p, num(size(m[p]), m[p]), num(size(m.at_peak[p]), m.at_peak[p])] }))
        .concat([{ attrs: { "data-part": "total" }, cells: ["total (each part at its largest)", num(size(m.total), m.total), ""] },
                 { attrs: { "data-part": "peak" }, cells: ["peak", "", num(size(m.peak), m.peak)] }])));
    if (fit) renderFit(fit, root);
  }

  function renderFit(f, root) {
    const a = f.assumptions;
    root.append(el("p", { class: "verdict", id: "fit", "data-fits": f.fits, "data-headroom": f.headroom },
      el("span", { class: f.fits ? "ok" : "bad", text: f.fits ? "fits" : "does not fit" }),
      ` on ${f.device.name} (${size(f.capacity)}): needs ${size(f.needed)} per rank = peak ${size(f.peak)} + ` +
      `${Math.round(a.allocator_overhead * 100)}% allocator overhead + ${size(a.runtime_reserve)} CUDA context and NCCL (assumed); ` +
      (f.fits ? `${size(f.headroom)} free.` : `${size(-f.headroom)} short.`)));
    if (!f.changes.length) return;
    root.append(table("changes", ["change (each checked by a dry run)", "--set", { text: "peak", num: true },
      { text: "needs", num: true }, "verdict"], f.changes.map((c) => ({
        attrs: { "data-fits": c.fits },
        cells: [c.change, { text: c.set.join(" "), attrs: {} }, num(size(c.peak), c.peak ?? ""),
          num(size(c.needed), c.needed ?? ""), c.error ? `not possible: ${c.error}` : c.fits ? "fits" : "does not fit"] }))));
    root.append(el("p", { id: "fit-conclusion", text: f.fitting ?
      `Fits with ${f.fitting.change}: ${f.fitting.set.map((s) => `--set '${s}'`).join(" ")}` :
      "None of these fits; pipeline stages (mesh.pp and a pipeline section) would divide the blocks' memory further." }));
  }

  function renderStepTime(st, root) {  // the cost model's estimate (docs/search.md)
    root.append(el("h2", { text: "Estimated step time" }));
    if (st.error) { root.append(el("p", { class: "bad", id: "step-time-error", text: st.error })); return; }
    const d = st.details, c = st.constants, s = (v) => `${v.toPrecision(4)} s`;
    root.append(table("step-time-terms", ["term", { text: "seconds per step", num: true }, { text: "share", num: true }],
      Object.entries(st.terms).map(([k, v]) => ({ attrs: { "data-term": k, "data-seconds": v },
        cells: [k === st.dominant ? `${k} (dominant)` : k, num(s(v)), num(`${(100 * v / st.step_time).toFixed(1)}%`)] }))));
    root.append(el("p", { id: "step-time", "data-step-time": st.step_time, "data-mfu": st.mfu,
      text: `${s(st.step_time)} per step on ${d.device.name} (${d.gpus_per_node} per node): ` +
        `${Math.round(st.tokens_per_s_per_device).toLocaleString("en-US")} tokens/s per device, MFU ${(100 * st.mfu).toFixed(1)}%. ` +
        `Constants (${c.source}): compute ${c.compute_efficiency}, intra-node ${c.intra_node_efficiency}, ` +
        `inter-node ${c.inter_node_efficiency}, fsdp_overlap ${c.fsdp_overlap}, tp_overlap ${c.tp_overlap}.` }));
  }

  function renderComm(c, mini, modules, root) {
    root.append(el("h2", { text: "Communication per rank per optimizer step" }));
    if (c.error) { root.append(el("p", { class: "bad", id: "comm-error", text: c.error })); return; }
    root.append(table("comm", ["source", "collective", "mesh dim", { text: "count", num: true },
      { text: "bytes", num: true }, { text: "wire bytes", num: true }], c.collectives.map((r) => ({
        attrs: { "data-source": r.source, "data-kind": r.kind, "data-dim": r.mesh_dim, "data-count": r.count },
        cells: [r.source, r.kind, r.mesh_dim, num(r.count), num(size(r.bytes), r.bytes), num(size(r.wire_bytes), r.wire_bytes)] }))));
    if (!mini) return;
    const cls = { at: "ok", above: "warn", below: "warn" }[mini.verdict] || "warn";
    root.append(el("h2", { text: "Tensor parallel against the Megatron minimum" }),
      el("p", { class: "verdict", id: "minimum", "data-verdict": mini.verdict },
        el("span", { class: cls, text: `TP ${mini.verdict} the minimum` }),
        `: ${size(mini.measured_wire_bytes)} per rank per step over tp; a Megatron-style ${mini.style} plan needs ${size(mini.wire_bytes)}.`));
    const diff = new Map(mini.extra.map((e) => [`${e.kind}/${e.pass}`, e]));
    const most = Math.max(1, ...mini.collectives.map((m) => {
      const e = diff.get(`${m.kind}/${m.pass}`);
      return Math.max(m.bytes, m.bytes + (e ? e.bytes : 0));
    }));
    root.append(table("minimum-table", ["collective", "pass", { text: "count", num: true }, { text: "minimum", num: true },
      { text: "bytes", num: true }, { text: "minimum", num: true }, "bytes against the minimum"], mini.collectives.map((m) => {
        const e = diff.get(`${m.kind}/${m.pass}`) || { count: 0, bytes: 0 };
        const bytes = m.bytes + e.bytes;
        return { attrs: { "data-kind": m.kind, "data-pass": m.pass, "data-count": m.count + e.count, "data-minimum": m.count },
          cells: [m.kind, m.pass, num(m.count + e.count), num(m.count), num(size(bytes), bytes), num(size(m.bytes), m.bytes),
            { text: "", attrs: { "data-bar": "" } }] };
      })));
    for (const row of document.querySelectorAll("#minimum-table tbody tr")) {  // the bars
      const cells = row.querySelectorAll("td");
      const measured = Number(cells[4].dataset.bytes), minimum = Number(cells[5].dataset.bytes);
      cells[6].append(el("span", { class: "bar", style: `width:${(220 * measured) / most}px;background:#4e79a7` }), el("br"),
        el("span", { class: "bar", style: `width:${(220 * minimum) / most}px;background:#bab0ac` }));
    }
    for (const r of mini.reasons || []) root.append(el("p", { class: "legend", text: "why: " + r.reason }));
    const blocks = new Set(modules.map((m) => (c.repeated_blocks && m.path.startsWith(c.repeated_blocks + ".")) ?
      m.path.slice(c.repeated_blocks.length + 1).split(".")[0] : null).filter((x) => x !== null)).size || 1;
    root.append(el("h3", { text: `Per module pattern (per block: ÷ ${blocks} blocks of ${c.repeated_blocks || "-"})` }),
      table("comm-modules", ["module", "pass", "collective", { text: "count", num: true }, { text: "per block", num: true },
        { text: "bytes", num: true }], c.tp_by_module.map((r) => {
          const inBlocks = c.repeated_blocks && r.module.startsWith(c.repeated_blocks + ".*");
          return { attrs: { "data-module": r.module, "data-kind": r.kind, "data-count": r.count },
            cells: [r.module, r.pass, r.kind, num(r.count), num(inBlocks ? r.count / blocks : "-"), num(size(r.bytes), r.bytes)] };
        })));
  }

  // ---- a run ------------------------------------------------------------------------
  function renderRun(d, root) {
    const run = d.run, rows = run.metrics;
    root.append(el("div", { class: "facts", id: "facts" }, fact("run folder", run.dir, "dir"),
      fact("steps logged", rows.length, "steps"), fact("world size", run.world_size ?? "-", "world_size"),
      fact("plan", run.plan_source || "plan.yaml", "plan")));
    const series = [["loss", "loss"], ["eval_loss", "validation loss"], ["val_loss", "validation loss"], ["tokens_per_s", "tokens/s (global)"],
                    ["grad_norm", "grad norm"], ["lr", "learning rate"]];
    const charts = el("div", { class: "charts", id: "charts" });
    // a fault-tolerant run's faults and rejoins (docs/fault-tolerance.md), marked on the curves
    const marks = (run.events || []).filter((e) => e.event === "fault" || e.event === "rejoin");
    for (const [key, label] of series) {
      const points = rows.filter((r) => typeof r[key] === "number" && isFinite(r[key])).map((r) => [r.step, r[key]]);
      if (points.length) charts.append(chart(key, label, points, key === "loss" || key === "tokens_per_s" ? marks : []));
    }
    root.append(el("h2", { text: "Training over steps (metrics.jsonl)" }), charts);
    if (rows.length) {
      const last = rows[rows.length - 1];
      const keys = Object.keys(last).filter((k) => typeof last[k] === "number");
      root.append(el("h3", { text: `Last step (${last.step})` }), table("last-step", keys,
        [{ cells: keys.map((k) => ({ text: fmt(last[k]), num: true, attrs: { "data-key": k, "data-value": last[k] } })) }]));
    }
    const est = run.estimate, dry = est && est.dry_run, got = est && est.measured;
    if (dry && got && dry.peak_bytes && got.peak_bytes)
      root.append(el("p", { id: "estimate", "data-measured": got.peak_bytes, "data-predicted": dry.peak_bytes },
        `Peak memory per rank: ${size(got.peak_bytes)} measured (${got.how}) against the dry run's ${size(dry.peak_bytes)} ` +
        `(×${(got.peak_bytes / dry.peak_bytes).toFixed(2)}).`));
    if (run.skipped_lines) root.append(el("p", { class: "warn", text: `${run.skipped_lines} line(s) of metrics.jsonl could not be read (a run cut off mid-line).` }));
    root.append(el("h2", { text: "The plan it ran" }), el("details", {}, el("summary", { text: "plan.yaml (resolved)" }),
      el("pre", { id: "plan-yaml", text: run.plan_yaml || "(no plan.yaml in the run folder)" })));
    if (d.plan) {
      const sub = el("section", { id: "plan" });
      root.append(sub);
      renderPlan(d.plan, sub);
    } else if (d.plan_error) root.append(el("p", { class: "bad", id: "plan-error", text: d.plan_error }));
  }
  const fmt = (v) => Math.abs(v) >= 1e5 ? Math.round(v).toLocaleString("en-US") : Number(v.toPrecision(4)).toString();

  function chart(key, label, points, marks = []) {
    const W = 440, H = 200, L = 56, B = 24, T = 10, R = 10;
    const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
    const [x0, x1] = [Math.min(...xs), Math.max(...xs)], [y0, y1] = [Math.min(...ys), Math.max(...ys)];
    const sx = (x) => L + (x1 === x0 ? 0.5 : (x - x0) / (x1 - x0)) * (W - L - R);
    const sy = (y) => H - B - (y1 === y0 ? 0.5 : (y - y0) / (y1 - y0)) * (H - B - T);
    const box = svg("svg", { width: "100%", viewBox: `0 0 ${W} ${H}`, class: "chart",
      "data-series": key, "data-points": points.length, "data-last": points[points.length - 1][1],
      "data-first": points[0][1], "data-min": y0, "data-max": y1 },
      svg("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }),
      svg("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }),
      svg("text", { x: 2, y: T + 8, text: fmt(y1) }), svg("text", { x: 2, y: H - B, text: fmt(y0) }),
      svg("text", { x: L, y: H - 6, text: `step ${x0}` }), svg("text", { x: W - R - 60, y: H - 6, text: `step ${x1}` }),
      svg("polyline", { fill: "none", stroke: "#4e79a7", "stroke-width": 1.6,
        points: points.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ") }));
    marks.filter((m) => m.step >= x0 && m.step <= x1).forEach((m, i) => {  // a dashed line and its label
      const x = sx(m.step).toFixed(1), colour = m.event === "fault" ? "#c2410c" : "#1f8a4c";
      box.append(svg("g", { class: "event", "data-event": m.event, "data-step": m.step, "data-x": x },
        svg("line", { x1: x, x2: x, y1: T, y2: H - B, stroke: colour, "stroke-dasharray": "4,3" }),
        svg("text", { x: Number(x) + 3, y: T + 10 + 12 * (i % 3), fill: colour, text: `${m.event} (${m.replicas ?? "?"})` }),
        svg("title", { text: `step ${m.step}: ${m.event}, ${m.replicas ?? "?"} replica groups` })));
    });
    return el("div", { class: "chart-box" }, el("h3", { text: `${label}: ${fmt(points[points.length - 1][1])} at step ${points[points.length - 1][0]}` }), box);
  }

  // ---- runs side by side (`tpplan report A B ...`) --------------------------------------
  function renderRuns(d, root) {
    root.append(el("div", { class: "facts", id: "facts" }, fact("runs", d.runs.length, "runs"),
      fact("baseline", d.baseline, "baseline")));
    root.append(el("p", { class: "legend", id: "run-legend" }, ...d.runs.map((r, i) =>
      el("span", { "data-run": i }, el("span", { class: "swatch", style: `background:${PALETTE[i % PALETTE.length]}` }), `${r.dir}  `))));
    const labels = { loss: "loss", eval_loss: "validation loss", tokens_per_s: "tokens/s (global)", grad_norm: "grad norm" };
    const charts = el("div", { class: "charts", id: "charts" });
    for (const key of d.series) {
      const lines = d.runs.map((r) => r.metrics.filter((m) => typeof m[key] === "number" && isFinite(m[key])).map((m) => [m.step, m[key]]));
      if (lines.some((l) => l.length)) charts.append(overlay(key, labels[key] || key, lines));
    }
    root.append(el("h2", { text: "Over steps, overlaid" }), charts);
    root.append(el("h2", { text: "Where the losses part (against the first run)" }),
      table("partings", ["run", "first step apart", { text: "loss", num: true }, { text: "baseline", num: true },
        { text: "tolerance", num: true }, "why this tolerance"], d.partings.map((p) => ({
          attrs: { "data-run": p.run, "data-step": p.step === null ? "none" : p.step, "data-tolerance": p.tolerance },
          cells: [p.run, p.step === null ? `none in ${p.common_steps} common steps` : String(p.step),
            num(p.step === null ? "" : fmt(p.loss)), num(p.step === null ? "" : fmt(p.base_loss)), num(String(p.tolerance)), p.why] }))));
    root.append(el("h2", { text: "How the plans differ" }), d.differences.length ?
      table("differences", ["key", ...d.runs.map((r, i) => `run ${i + 1}`)], d.differences.map((x) => ({
        attrs: { "data-key": x.key }, cells: [x.key, ...x.values.map((v) => JSON.stringify(v) ?? "-")] }))) :
      el("p", { id: "differences", text: "The plans are the same." }));
  }

  function overlay(key, label, lines) {
    const W = 440, H = 200, L = 56, B = 24, T = 10, R = 10;
    const all = lines.flat();
    const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
    const [x0, x1] = [Math.min(...xs), Math.max(...xs)], [y0, y1] = [Math.min(...ys), Math.max(...ys)];
    const sx = (x) => L + (x1 === x0 ? 0.5 : (x - x0) / (x1 - x0)) * (W - L - R);
    const sy = (y) => H - B - (y1 === y0 ? 0.5 : (y - y0) / (y1 - y0)) * (H - B - T);
    const box = svg("svg", { width: "100%", viewBox: `0 0 ${W} ${H}`, class: "chart", "data-series": key, "data-runs": lines.length },
      svg("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }),
      svg("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }),
      svg("text", { x: 2, y: T + 8, text: fmt(y1) }), svg("text", { x: 2, y: H - B, text: fmt(y0) }),
      svg("text", { x: L, y: H - 6, text: `step ${x0}` }), svg("text", { x: W - R - 60, y: H - 6, text: `step ${x1}` }));
    lines.forEach((points, i) => {
      if (!points.length) return;
      box.append(svg("polyline", { fill: "none", stroke: PALETTE[i % PALETTE.length], "stroke-width": 1.6, "data-run": i,
        "data-points": points.length, "data-last": points[points.length - 1][1], "data-first": points[0][1],
        points: points.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ") }));
    });
    return el("div", { class: "chart-box" }, el("h3", { text: label }), box);
  }

  function renderSearch(d, root) {  // `tpplan search --json`: the ranked layouts, the drops
    root.append(el("h2", { text: `The ${d.ranked.length} fastest layouts that fit (estimated)` }));
    root.append(table("ranked", [{ text: "#", num: true }, { text: "tokens/s/GPU", num: true },
      { text: "step", num: true }, { text: "MFU", num: true }, "dominant", { text: "headroom", num: true }, "--set"],
      d.ranked.map((r, i) => ({
        attrs: { "data-rank": i + 1, "data-tokens": r.tokens_per_s_per_device, "data-peak": r.peak,
                 "data-headroom": r.headroom, "data-dominant": r.dominant },
        cells: [num(i + 1), num(Math.round(r.tokens_per_s_per_device).toLocaleString("en-US"), r.tokens_per_s_per_device),
          num(`${r.step_time.toPrecision(3)} s`, r.step_time), num(`${(100 * r.mfu).toFixed(1)}%`, r.mfu),
          r.dominant, num(size(r.headroom), r.headroom), r.sets.map((s) => `--set '${s}'`).join(" ")] }))));
    root.append(el("p", { id: "search-counts", text: `${d.candidates} candidates: ${d.passed_checks} pass the plan's ` +
      `checks, ${d.fitting} checked to fit; not analysed further, their bound already slower than the last ` +
      `layout shown: ${d.not_ranked.fitting} that fit, ${d.not_ranked.comm_only} bounded by their ` +
      `communication, ${d.not_ranked.bound_only} by arithmetic alone.` }));
    root.append(el("h2", { text: "Dropped, by reason" }));
    root.append(table("dropped", [{ text: "count", num: true }, "reason", "example"], d.dropped.map((x) => ({
      attrs: { "data-count": x.count }, cells: [num(x.count), x.reason, x.example.join(" ")] }))));
  }

  try {
    const data = JSON.parse(document.getElementById("data").textContent);
    const main = document.getElementById("main");
    const kind = document.body.dataset.kind;
    if (kind === "run") renderRun(data, main); else if (kind === "runs") renderRuns(data, main);
    else if (kind === "search") renderSearch(data, main);
    else renderPlan(data, main);
    document.body.dataset.rendered = "yes";
  } catch (e) {
    report(String(e && e.stack ? e.stack : e));
  }
})();
