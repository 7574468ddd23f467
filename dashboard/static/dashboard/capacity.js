// Capacity review charts: state with its fitted growth, batch time against the trigger, sizes, input against capacity.
(function () {
  const data = JSON.parse(document.getElementById("capacity-data").textContent);
  const printable = document.body.classList.contains("printable");
  const base = (title, y, y2, range) => {
    const spec = { title: { text: title, font: { size: 14 } }, height: 260, margin: { l: 64, r: y2 ? 64 : 20, t: 36, b: 40 },
      xaxis: { type: "date", title: { text: "hour (UTC)" }, range, tickformat: "%b %d %H:%M" }, yaxis: { title: { text: y }, rangemode: "tozero" }, legend: { orientation: "h", y: -0.35 } };
    if (y2) spec.yaxis2 = { title: { text: y2 }, overlaying: "y", side: "right", rangemode: "tozero" };
    return spec;
  };
  const line = (name, x, y, extra) => Object.assign({ name, x, y, type: "scatter", mode: "lines" }, extra || {});
  document.querySelectorAll("[data-chart]").forEach((el) => {
    const s = data[el.dataset.job];
    let traces = [], layout;
    if (el.dataset.chart === "state") {
      traces = [line("state rows", s.t, s.rows), line("state size (bytes)", s.t, s.bytes, { yaxis: "y2" })];
      layout = base("State", "rows", "bytes", s.range);
    } else if (el.dataset.chart === "duration") {
      traces = [line("batch time, hourly average", s.t, s.dur_avg), line("batch time, hourly max", s.t, s.dur_max),
        line("trigger interval", s.t, s.t.map(() => s.trigger_ms), { line: { dash: "dash", color: "#f5222d" } })];
      layout = base("Batch time against the trigger", "ms", null, s.range);
    } else if (el.dataset.chart === "size") {
      traces = [{ name: "checkpointed per hour", x: s.t, y: s.ckpt, type: "bar" }, line("full checkpoint", s.t, s.full, { yaxis: "y2" })];
      layout = base("Checkpoint size", "bytes per hour", "bytes", s.range);
    } else {
      const capacity = parseFloat(el.dataset.capacity);
      traces = [line("input rate, hourly average", s.t, s.in_rate)];
      if (capacity) traces.push(line("processing capacity", s.t, s.t.map(() => capacity), { line: { dash: "dash", color: "#52c41a" } }));
      layout = base("Input rate against capacity", "rows / s", null, s.range);
    }
    Plotly.react(el, traces, layout, { displaylogo: false, responsive: !printable, staticPlot: printable });
  });
})();
