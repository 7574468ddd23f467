// State tab: commit time per state partition (stragglers in red) and bytes on disk.
(function () {
  // State partitions: commit time per partition (stragglers in red) and bytes on disk
  const partitionData = document.getElementById("partition-data");
  if (!partitionData) return;
  {
    const rows = JSON.parse(partitionData.textContent);
    const label = rows.map((r) => `op ${r.op} · p${r.part}`);
    Plotly.react("chart-partitions", [
      { name: "commit p50 (ms)", type: "bar", x: label, y: rows.map((r) => r.commit_p50),
        marker: { color: rows.map((r) => (r.straggler ? "#f5222d" : "#1890ff")) } },
      { name: "bytes on disk", type: "scatter", mode: "markers", x: label, y: rows.map((r) => r.bytes), yaxis: "y2", marker: { color: "#fa8c16", size: 8 } },
    ], {
      title: { text: "Commit time and size per state partition", font: { size: 14 } }, height: 300, margin: { l: 64, r: 64, t: 36, b: 70 },
      xaxis: { type: "category", title: { text: "state partition" } }, yaxis: { title: { text: "commit p50 (ms after batch start)" }, rangemode: "tozero" },
      yaxis2: { title: { text: "bytes on disk" }, overlaying: "y", side: "right", rangemode: "tozero" }, legend: { orientation: "h", y: -0.35 },
    }, { displaylogo: false, responsive: true });
  }
})();
