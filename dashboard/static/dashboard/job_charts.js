// Job page charts: loaded from series.json, then extended by server-sent events, one per committed batch.
// EventSource resends the last event id on reconnect, and the server replays from there: no point is missed.
(function () {
  const root = document.getElementById("charts");
  if (!root) return;
  const seriesUrl = root.dataset.series, liveUrl = root.dataset.live;
  const layout = (title, y, y2) => {
    const spec = {
      title: { text: title, font: { size: 14 } }, height: 280, margin: { l: 64, r: y2 ? 64 : 20, t: 36, b: 40 },
      xaxis: { type: "date", title: { text: "committed at (UTC)" } }, yaxis: { title: { text: y }, rangemode: "tozero" },
      legend: { orientation: "h", y: -0.3 }, barmode: "stack",
    };
    if (y2) spec.yaxis2 = { title: { text: y2 }, overlaying: "y", side: "right", rangemode: "tozero" };
    return spec;
  };
  // [element id, title, y title, y2 title, traces: [name, field, type, axis]]
  const charts = [
    ["chart-lag", "Consumer lag", "records", "seconds", [["lag (records)", "lag", "scatter", "y"], ["lag (seconds)", "lag_s", "scatter", "y2"]]],
    ["chart-rates", "Input against processed rate", "rows / s", null, [["input", "in_rate", "scatter", "y"], ["processed", "proc_rate", "scatter", "y"]]],
    ["chart-duration", "Batch duration by part", "ms", null, [["WAL commit", "wal", "bar", "y"], ["addBatch", "add", "bar", "y"], ["commit offsets", "commit", "bar", "y"], ["planning + latestOffset", "plan", "bar", "y"]]],
    ["chart-state", "State", "rows", "bytes in memory", [["state rows", "state_rows", "scatter", "y"], ["state memory", "state_mem", "scatter", "y2"]]],
    ["chart-size", "Checkpoint size", "bytes", null, [["checkpointed (this batch)", "ckpt", "bar", "y"], ["full checkpoint", "full", "scatter", "y"]]],
  ];
  const seen = new Set();
  let points = [], trigger = 2, source = null, lastId = null;
  const key = (p) => p.location + ":" + p.batch;

  function traces(spec, pts) {
    return spec[4].map(([name, field, type, axis]) => ({
      name, type, yaxis: axis, x: pts.map((p) => p.t), y: pts.map((p) => p[field]),
      mode: type === "scatter" ? "lines+markers" : undefined, marker: { size: 4 },
    }));
  }

  function draw() {
    for (const spec of charts) Plotly.react(spec[0], traces(spec, points), layout(spec[1], spec[2], spec[3]), { displaylogo: false, responsive: true });
    root.dataset.points = String(points.length);
    showStatus();
  }

  function add(p) {
    if (seen.has(key(p))) return false;
    seen.add(key(p));
    points.push(p);
    for (const spec of charts) {
      const update = { x: [], y: [] };
      for (const [, field] of spec[4]) { update.x.push([p.t]); update.y.push([p[field]]); }
      Plotly.extendTraces(spec[0], update, spec[4].map((_, i) => i));
    }
    root.dataset.points = String(points.length);
    showStatus();
    return true;
  }

  // The same rules as dashboard/live.py lag_status, over the last 10 checkpoints
  function status() {
    const w = points.slice(-10);
    if (!w.length) return ["", "no checkpoint yet"];
    const last = w[w.length - 1], quiet = (Date.now() - Date.parse(last.t)) / 1000, allowed = Math.max(60, 10 * trigger);
    if (quiet > allowed) return ["STOP", `no commit for ${quiet.toFixed(0)} s`];
    const ends = w.filter((p) => p.end_n !== null && p.location === last.location).map((p) => p.end_n);
    if (ends.some((v, i) => i && v < ends[i - 1])) return ["REWIND", "source offsets went back"];
    const lags = w.filter((p) => p.lag !== null).map((p) => p.lag);
    const lastLag = lags[lags.length - 1];
    if (w.length >= 3 && new Set(ends).size === 1 && lastLag > 0) return ["STALL", `offsets stay at ${ends[0]} with ${lastLag} records waiting`];
    if (lags.length >= 3 && lastLag > 0 && lags.every((v, i) => !i || v >= lags[i - 1])) return ["WARN", `lag never falls (${lags[0]} → ${lastLag} records)`];
    const gain = last.proc_rate - last.in_rate;
    const drain = !lastLag ? "nothing to drain" : gain > 0 ? `drains in ${(lastLag / gain).toFixed(0)} s` : "not draining";
    return ["OK", drain];
  }

  function showStatus() {
    const [s, why] = status(), el = document.getElementById("lag-status");
    el.className = "badge lag-" + (s || "none").toLowerCase();
    el.textContent = s || "–";
    document.getElementById("lag-reason").textContent = why;
  }

  function connect(after) {
    if (source) source.close();
    const url = liveUrl + (after ? "?after=" + encodeURIComponent(after) : "");
    source = new EventSource(url);
    source.addEventListener("checkpoint", (e) => { lastId = e.lastEventId; add(JSON.parse(e.data)); });
    source.onopen = () => { document.getElementById("live-state").textContent = "live"; };
    source.onerror = () => { document.getElementById("live-state").textContent = "reconnecting…"; };
  }

  async function load(range) {
    const data = await (await fetch(seriesUrl + "?range=" + range)).json();
    trigger = data.trigger;
    points = data.points; seen.clear(); points.forEach((p) => seen.add(key(p)));
    draw();
    connect(lastId || data.follow);
  }

  document.querySelectorAll("[data-range]").forEach((b) => b.addEventListener("click", () => {
    document.querySelectorAll("[data-range]").forEach((o) => o.classList.toggle("on", o === b));
    load(b.dataset.range);
  }));
  // For tests and operators: drop the connection and resume from the last event received
  window.statekeeperLive = { reconnect: () => connect(lastId), disconnect: () => source && source.close(), points: () => points };
  setInterval(showStatus, 5000); // STOP is the absence of events: re-judge even when nothing arrives
  load("15m");
})();
