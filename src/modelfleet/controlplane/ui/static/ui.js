// The dashboard's own script: draws the plots of a live part each time it is (re)rendered,
// and keeps an engine log scrolled to its end. Everything else is htmx.
(function () {
  "use strict";
  var COLORS = ["#2b6cb0", "#c53030", "#2f855a", "#b7791f", "#6b46c1", "#319795"];

  function lines(box, el) {
    var d = JSON.parse(box.dataset.plot);
    if (box.dataset.kind === "usage") {
      var keys = Object.keys(d.series);
      return { xs: d.at, names: keys, ys: keys.map(function (k) { return d.series[k]; }) };
    }
    var names = el.dataset.series.split(",");
    return { xs: d.at, names: names, ys: names.map(function (n) { return d[n]; }) };
  }

  function draw(root) {
    if (typeof uPlot === "undefined") return;
    root.querySelectorAll("[data-plot]").forEach(function (box) {
      box.querySelectorAll(".plot").forEach(function (el) {
        var got = lines(box, el);
        el.textContent = "";
        if (!got.xs.length) {
          el.textContent = "no numbers yet";
          return;
        }
        var series = [{}].concat(got.names.map(function (n, i) {
          return { label: n, stroke: COLORS[i % COLORS.length], width: 1.5 };
        }));
        var opts = { width: Math.max(300, el.clientWidth || 600), height: 180, series: series };
        if (got.xs.length === 1) {
          // One point: an hour either side, instead of uPlot's guess of years.
          opts.scales = { x: { time: true, range: [got.xs[0] - 3600, got.xs[0] + 3600] } };
        }
        new uPlot(opts, [got.xs].concat(got.ys), el);
      });
    });
  }

  document.addEventListener("DOMContentLoaded", function () { draw(document); });
  document.addEventListener("htmx:afterSettle", function (e) { draw(e.target); });
  document.addEventListener("htmx:sseMessage", function () {
    var log = document.getElementById("log");
    if (log) log.scrollTop = log.scrollHeight;
  });
})();
