// Job page charts: loaded from series.json, then extended by server-sent events, one per committed batch, and
// marked with incidents (starts, stops, failures, restarts, savepoints, rescales, rollbacks, alerts) on the same axis.
// EventSource resends the last event id on reconnect, and the server replays from there: no point is missed.
(function () {
  const root = document.getElementById("charts");
  if (!root) return;
  const seriesUrl = root.dataset.series, liveUrl = root.dataset.live;
  const INCIDENT_COLORS = {
    start: "#52c41a", stop: "#8c8c8c", failure: "#f5222d", restart: "#fa541c", alert: "#cf1322", "all-clear": "#389e0d",
    savepoint: "#1890ff", "stop-with-savepoint": "#1890ff", restore: "#722ed1", rollback: "#722ed1", rescale: "#13c2c2",
  };
  const color = (kind) => INCIDENT_COLORS[kind] || "#595959";
  // every incident is a dotted vertical line on every chart: what happened lines up with what it did to the job
  const shapes = () => incidents.map((e) => ({
    type: "line", xref: "x", yref: "paper", x0: e.t, x1: e.t, y0: 0, y1: 1,
    line: { color: color(e.kind), width: 1, dash: "dot" },
  }));
  const RANGE_MS = { "15m": 9e5, "1h": 36e5, "6h": 216e5, "1d": 864e5, "1w": 6048e5, "4w": 24192e5 };
  let rangeMs = RANGE_MS["15m"];
  const layout = (title, y, y2) => {
    const spec = {
      shapes: shapes(),
      title: { text: title, font: { size: 14 } }, height: 280, margin: { l: 64, r: y2 ? 64 : 20, t: 36, b: 40 },
      xaxis: { type: "date", title: { text: "committed at (UTC)" } }, yaxis: { title: { text: y }, rangemode: "tozero" },
      legend: { orientation: "h", y: -0.3 }, barmode: "stack",
    };
    if (y2) spec.yaxis2 = { title: { text: y2 }, overlaying: "y", side: "right", rangemode: "tozero" };
    if (!points.length) {  // the range itself, and why it is empty: Plotly alone would span a single instant
      const now = Date.now();
      spec.xaxis.range = [new Date(now - rangeMs).toISOString(), new Date(now).toISOString()];
      spec.annotations = [{ text: "no batch committed in this range", showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5 }];
    }
    return spec;
  };
  // [element id, title, y title, y2 title, traces: [name, field, type, axis]]; a null name is the measure's label
  // from the server (dashboard/records.py), so the charts call a figure what the tables call it
  const charts = [
    ["chart-lag", "Consumer lag", "records", "seconds", [["lag (records)", "lag", "scatter", "y"], ["lag (seconds)", "lag_s", "scatter", "y2"]]],
    ["chart-rates", "Input against processed rate", "rows / s", "rows dropped", [[null, "in_rate", "scatter", "y"], [null, "proc_rate", "scatter", "y"], [null, "dropped", "bar", "y2"]]],
    ["chart-duration", "Batch duration by part", "ms", null, [[null, "wal", "bar", "y"], [null, "add", "bar", "y"], [null, "commit", "bar", "y"], [null, "plan", "bar", "y"]]],
    ["chart-state", "State per operator", "rows", "bytes", [[null, "state_rows", "scatter", "y"], [null, "state_mem", "scatter", "y2"]]],
    ["chart-size", "Checkpointed against full checkpoint size", "bytes", null, [[null, "ckpt", "bar", "y"], [null, "full", "scatter", "y"]]],
    ["chart-ckpt-duration", "Checkpoint duration", "ms", null, [[null, "dur", "scatter", "y"], [null, "state_commit", "scatter", "y"]]],
  ];
  const seen = new Set();
  let points = [], incidents = [], source = null, lastId = null, resolution = "batch", labels = {}, sourcePoints = [];
  const incidentKeys = new Set(), latencies = [];
  const key = (p) => p.location + ":" + p.batch;

  const value = (p, field) => (typeof field === "function" ? field(p) : p[field]);
  // one pair of traces per stateful operator when the job has several (roll-ups keep the totals only)
  // RocksDB's memoryUsedBytes is its memtables and pinned blocks, which come and go (it drops to 0 every few
  // batches): a RocksDB job's state is charted as its SST files' size instead, the figure the job list shows
  function stateTraces() {
    const n = Math.max(0, ...points.map((p) => (p.ops || []).length));
    const rocksdb = points.some((p) => p.state_sst !== null && p.state_sst !== undefined);
    if (n < 2) return [[null, "state_rows", "scatter", "y"], [null, rocksdb ? "state_sst" : "state_mem", "scatter", "y2"]];
    const out = [];
    for (let i = 0; i < n; i += 1) {
      out.push([`op ${i} rows`, (p) => (p.ops && p.ops[i] ? p.ops[i][0] : null), "scatter", "y"]);
      out.push([rocksdb ? `op ${i} SST files` : `op ${i} memory`,
        (p) => (p.ops && p.ops[i] ? p.ops[i][rocksdb ? 2 : 1] : null), "scatter", "y2"]);
    }
    return out;
  }

  function traces(spec, pts) {
    return spec[4].map(([name, field, type, axis]) => ({
      name: name || (labels[field] ? labels[field].label : String(field)), type, yaxis: axis, x: pts.map((p) => p.t), y: pts.map((p) => value(p, field)),
      mode: type === "scatter" ? "lines+markers" : undefined, marker: { size: 4 },
    }));
  }

  // from the first point or incident to now (a timeline of one point would otherwise zoom to a second); with no
  // point, the range, as the charts above it
  function span() {
    const times = points.map((p) => p.t).concat(incidents.map((e) => e.t)).sort();
    const now = Date.now();
    return [points.length ? times[0] : new Date(now - rangeMs).toISOString(), new Date(now).toISOString()];
  }

  function drawIncidents() {
    // one row per kind of incident, hover for what happened
    const kinds = [...new Set(incidents.map((e) => e.kind))];
    const data = kinds.map((kind) => {
      const own = incidents.filter((e) => e.kind === kind);
      return { name: kind, type: "scatter", mode: "markers", x: own.map((e) => e.t), y: own.map(() => kind),
        text: own.map((e) => e.text), hoverinfo: "x+text", marker: { size: 11, symbol: "diamond", color: color(kind) } };
    });
    const range = span();
    Plotly.react("chart-incidents", data, {
      title: { text: "Incident timeline", font: { size: 14 } }, height: 110 + 22 * kinds.length, margin: { l: 130, r: 20, t: 36, b: 40 },
      xaxis: { type: "date", title: { text: "UTC" }, range }, yaxis: { type: "category", automargin: true }, showlegend: false,
      annotations: incidents.length ? [] : [{ text: "no incidents in this range", showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5 }],
    }, { displaylogo: false, responsive: true });
    document.getElementById("chart-incidents").dataset.incidents = String(incidents.length);
  }

  // Lag read from the source every few seconds (dashboard/services/source_lag.py): it goes on while the job is down,
  // when no checkpoint comes. Drawn after the checkpoint traces, so live checkpoints extend theirs (0 and 1).
  const sourceTraces = () => [
    { name: "lag from the source (records)", type: "scatter", mode: "lines", yaxis: "y", x: sourcePoints.map((s) => s.t), y: sourcePoints.map((s) => s.lag), line: { dash: "dot", color: "#cf1322" } },
    { name: "oldest entry waiting (s)", type: "scatter", mode: "lines", yaxis: "y2", x: sourcePoints.map((s) => s.t), y: sourcePoints.map((s) => s.age), line: { dash: "dot", color: "#fa8c16" } },
  ];

  function addSource(s) {
    sourcePoints.push(s);
    Plotly.extendTraces("chart-lag", { x: [[s.t], [s.t]], y: [[s.lag], [s.age]] }, [2, 3]);
    document.getElementById("chart-lag").dataset.source = String(sourcePoints.length);
  }

  function draw() {
    charts.find((c) => c[0] === "chart-state")[4] = stateTraces();
    for (const spec of charts) {
      const data = traces(spec, points).concat(spec[0] === "chart-lag" ? sourceTraces() : []);
      Plotly.react(spec[0], data, layout(spec[1], spec[2], spec[3]), { displaylogo: false, responsive: true });
    }
    document.getElementById("chart-lag").dataset.source = String(sourcePoints.length);
    drawIncidents();
    root.dataset.points = String(points.length);
    document.getElementById("chart-resolution").textContent = {
      batch: "One point per committed batch (thinned to 3,000 at most).",
      minute: "One point per minute: averages, the largest lag and the last state size of the minute; newest batches after the last complete minute.",
      hour: "One point per hour: averages, the largest lag and the last state size of the hour; newest batches after the last complete hour.",
    }[resolution];
  }

  function addIncident(e) {
    if (incidentKeys.has(e.key)) return;
    incidentKeys.add(e.key);
    incidents.push(e);
    incidents.sort((a, b) => (a.t < b.t ? -1 : 1));
    for (const spec of charts) Plotly.relayout(spec[0], { shapes: shapes() });
    drawIncidents();
    refreshFacts();
  }

  function add(p) {
    if (seen.has(key(p))) return false;
    seen.add(key(p));
    points.push(p);
    if (points.length === 1) {  // the first of the range: drawn afresh, without the empty range's note
      draw();
      return true;
    }
    for (const spec of charts) {
      const update = { x: [], y: [] };
      for (const [, field] of spec[4]) { update.x.push([p.t]); update.y.push([value(p, field)]); }
      Plotly.extendTraces(spec[0], update, spec[4].map((_, i) => i));
    }
    root.dataset.points = String(points.length);
    Plotly.relayout("chart-incidents", { "xaxis.range": span() }); // the timeline spans what the charts span
    return true;
  }

  // The parts of the page that a run's start or end, an action or an alert changes (the buttons, the notices, the
  // overview's facts) are taken from the page rendered afresh: the server renders them one way only. Answers that
  // arrive out of order are dropped; a failed fetch (the console restarting) waits for the next event.
  let shownRun, refreshes = 0, refreshTimer = null, refreshedAt = Date.now();
  function refreshFacts() {
    window.clearTimeout(refreshTimer);
    refreshedAt = Date.now();
    refreshTimer = window.setTimeout(async () => {
      const mine = ++refreshes;
      try {
        const response = await fetch(window.location.href, { headers: { Accept: "text/html" } });
        if (!response.ok || mine !== refreshes) return;
        const fresh = new DOMParser().parseFromString(await response.text(), "text/html");
        if (mine !== refreshes) return;
        for (const id of ["job-actions", "job-notices", "job-facts"]) {
          const now = document.getElementById(id), next = fresh.getElementById(id);
          if (now && next) now.replaceWith(document.adoptNode(next));
        }
        root.dataset.refreshed = String(mine);
      } catch (error) {
        // the console restarting: the next incident or status tries again
      }
    }, 250);
  }

  // The facts age too (the last checkpoint, the lag read from the source while the job is down, the heap): a batch, a
  // source sample or a keep-alive takes them afresh when they are FACTS_EVERY_MS old, so the overview never tells
  // another lag than the header for longer than that.
  const FACTS_EVERY_MS = 4000;  // under the source samples' 5 s: each of them is shown
  function refreshIfOld() {
    if (Date.now() - refreshedAt >= FACTS_EVERY_MS) refreshFacts();
  }

  // The lag status is judged on the server (dashboard/selectors/lag.py): it comes with the series, with every point
  // pushed, and with every keep-alive of the live stream (STOP is the absence of commits).
  function showStatus(status) {
    if (!status) return;
    const el = document.getElementById("lag-status");
    el.className = "badge lag-" + (status.status || "none").toLowerCase();
    el.textContent = status.status || "–";
    const drain = status.drain_seconds ? `, drains in ${status.drain_seconds.toFixed(0)} s` : "";
    document.getElementById("lag-reason").textContent = status.reason + drain;
    if (status.run === undefined) return;  // a checkpoint's status: the run is as it was
    const runKey = JSON.stringify(status.run);
    const run = document.getElementById("run-status");
    // the first status (with the series, fetched after the page) is compared with the run the page was rendered
    // with: a run that ended in between would otherwise leave its buttons on the page (Stop, and no Start)
    const changed = shownRun === undefined
      ? (status.run ? status.run.status : "") !== run.dataset.rendered
      : runKey !== shownRun;
    if (changed) refreshFacts();
    shownRun = runKey;
    run.className = "badge b-" + (status.run ? status.run.status : "none");
    run.textContent = status.run ? status.run.status : "never run";
    const message = status.run && status.run.message;  // cut on the server as the template cuts it
    document.getElementById("run-message").textContent = message ? "· " + message : "";
  }

  function connect(after) {
    if (source) source.close();
    const url = liveUrl + (after ? "?after=" + encodeURIComponent(after) : "");
    source = new EventSource(url);
    source.addEventListener("checkpoint", (e) => {
      lastId = e.lastEventId;
      const p = JSON.parse(e.data);
      // commit to browser: the batch committed at its trigger time plus its duration
      if (add(p)) latencies.push(Date.now() - (Date.parse(p.t) + p.dur));
      showStatus(p.status);
      refreshIfOld();
    });
    source.addEventListener("incident", (e) => { lastId = e.lastEventId; addIncident(JSON.parse(e.data)); });
    source.addEventListener("status", (e) => { showStatus(JSON.parse(e.data)); refreshIfOld(); });
    source.addEventListener("source", (e) => { lastId = e.lastEventId; addSource(JSON.parse(e.data)); refreshIfOld(); });
    source.onopen = () => { document.getElementById("live-state").textContent = "live"; };
    source.onerror = () => { document.getElementById("live-state").textContent = "reconnecting…"; };
  }

  async function load(range) {
    const data = await (await fetch(seriesUrl + "?range=" + range)).json();
    rangeMs = RANGE_MS[range] || rangeMs;
    resolution = data.resolution; labels = data.labels; sourcePoints = data.source;
    points = data.points; seen.clear(); points.forEach((p) => seen.add(key(p)));
    incidents = data.incidents; incidentKeys.clear(); incidents.forEach((e) => incidentKeys.add(e.key));
    draw();
    showStatus(data.status);
    connect(lastId || data.follow);
  }

  document.querySelectorAll("[data-range]").forEach((b) => b.addEventListener("click", () => {
    document.querySelectorAll("[data-range]").forEach((o) => o.classList.toggle("on", o === b));
    load(b.dataset.range);
  }));
  // For tests and operators: drop the connection and resume from the last event received
  window.statekeeperLive = {
    reconnect: () => connect(lastId), disconnect: () => source && source.close(), points: () => points, incidents: () => incidents,
    source: () => sourcePoints,
    latencies: () => latencies,
  };
  load("15m");
})();
