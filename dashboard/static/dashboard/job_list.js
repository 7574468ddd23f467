// Job list: a sparkline of lag and of state in memory per job over the last hour, extended live by server-sent events
// (one per committed batch of any job); the lag, state and last-checkpoint cells follow the same events.
(function () {
  const root = document.getElementById("jobs");
  if (!root) return;
  const trends = JSON.parse(document.getElementById("trends").textContent);
  const HOUR = 3600 * 1000;
  const bytes = (v) => {
    let size = v, units = ["B", "KB", "MB", "GB", "TB"], i = 0;
    while (Math.abs(size) >= 1024 && i < units.length - 1) { size /= 1024; i += 1; }
    return i ? size.toFixed(1) + " " + units[i] : size.toFixed(0) + " B";
  };

  function spark(el, xs, ys, unit) {
    const colour = el.dataset.spark === "lag" ? "#fa8c16" : "#1890ff";
    Plotly.react(el, [{ x: xs, y: ys, type: "scatter", mode: "lines", line: { width: 1.5, color: colour },
      fill: "tozeroy", hovertemplate: "%{y} " + unit + "<br>%{x}<extra></extra>" }],
    { margin: { l: 0, r: 0, t: 2, b: 2 }, height: 34, width: 110, xaxis: { visible: false, type: "date" },
      yaxis: { visible: false, rangemode: "tozero" }, showlegend: false },
    { displayModeBar: false, staticPlot: false });
    el.dataset.points = String(xs.length);
  }

  for (const row of root.querySelectorAll("tr[data-job]")) {
    const trend = trends[row.dataset.job] || { t: [], lag: [], state: [] };
    for (const el of row.querySelectorAll("[data-spark]")) spark(el, trend.t, trend[el.dataset.spark], el.dataset.unit);
  }

  function extend(el, t, value) {
    const cutoff = new Date(Date.parse(t) - HOUR).toISOString();
    Plotly.extendTraces(el, { x: [[t]], y: [[value]] }, [0]);
    const data = el.data[0]; // keep an hour: drop what scrolled out
    let drop = 0;
    while (drop < data.x.length && data.x[drop] < cutoff) drop += 1;
    if (drop) Plotly.restyle(el, { x: [data.x.slice(drop)], y: [data.y.slice(drop)] }, [0]);
    el.dataset.points = String(el.data[0].x.length);
  }

  // lag read from the source every few seconds: true while a job is down, when no checkpoint comes
  function onSource(s) {
    const row = root.querySelector(`tr[data-job="${s.job}"]`);
    if (!row) return;
    const cell = row.querySelector('[data-cell="lag"]');
    cell.replaceChildren(String(s.lag));
    if (s.age) cell.append(document.createElement("br"), Object.assign(document.createElement("span"), { className: "muted", textContent: `oldest ${s.age.toFixed(0)} s` }));
    extend(row.querySelector('[data-spark="lag"]'), s.t, s.lag);
  }

  function onCheckpoint(p) {
    const row = root.querySelector(`tr[data-job="${p.job}"]`);
    if (!row) return;
    for (const el of row.querySelectorAll("[data-spark]")) extend(el, p.t, el.dataset.spark === "lag" ? p.lag : p.state_mem);
    row.querySelector('[data-cell="last"]').textContent = "#" + p.batch + " · just now";
    row.querySelector('[data-cell="rows"]').textContent = String(p.state_rows);
    const size = row.querySelector('[data-cell="size"]');
    // as the page renders it: a RocksDB job's state is its SST files, Spark's memory figure comes and goes
    const rocksdb = p.state_sst !== null && p.state_sst !== undefined;
    const figure = Object.assign(document.createElement("span"), rocksdb
      ? { title: "RocksDB's SST files", textContent: bytes(p.state_sst) + " RocksDB" }
      : { title: "Spark's memoryUsedBytes", textContent: bytes(p.state_mem) });
    size.replaceChildren(figure, document.createElement("br"), Object.assign(document.createElement("span"), { className: "muted", textContent: bytes(p.full) + " on disk" }));
  }

  let lastId = root.dataset.follow;
  const source = new EventSource(root.dataset.live + (lastId ? "?after=" + encodeURIComponent(lastId) : ""));
  source.addEventListener("checkpoint", (e) => { lastId = e.lastEventId; onCheckpoint(JSON.parse(e.data)); });
  source.addEventListener("source", (e) => { lastId = e.lastEventId; onSource(JSON.parse(e.data)); });
})();
