// The dashboard's own script: draws the plots of a live part each time it is (re)rendered,
// and keeps an engine log scrolled to its end. Everything else is htmx.
(function () {
  "use strict";
  var COLORS = ["#2b6cb0", "#c53030", "#2f855a", "#b7791f", "#6b46c1", "#319795"];

  function lines(box, el) {
    var d = JSON.parse(box.dataset.plot);
    if (box.dataset.kind === "keys") {
      // One line per key, of the one measure this plot shows.
      var per = d[el.dataset.series] || {};
      var keys = Object.keys(per);
      return { xs: d.at, names: keys, ys: keys.map(function (k) { return per[k]; }) };
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

  // A live page says when it stops being live: its stream says it is alive every 2 s
  // (ALIVE_EVERY_S), so 6 s of silence, or an error, means what it shows may be old. Then
  // /ui/alive tells a control plane gone (no answer) from a session gone (401: it restarted,
  // or the session ran out), which only signing in again mends.
  var QUIET_MS = 6000;
  var heard = Date.now();

  function stale(text, signIn) {
    var banner = document.getElementById("stale");
    if (!banner) return;
    var shown = new Date(heard).toLocaleTimeString();
    banner.textContent = text + " What this page shows is as of " + shown + ". ";
    if (signIn) {
      var link = document.createElement("a");
      link.href = "/ui/login";
      link.textContent = "Sign in again";
      banner.appendChild(link);
    }
    banner.hidden = false;
    document.body.classList.add("stale");
  }

  function live() {
    heard = Date.now();
    var banner = document.getElementById("stale");
    if (banner && !banner.hidden) {
      banner.hidden = true;
      document.body.classList.remove("stale");
    }
  }

  var asking = false;
  function check() {
    if (asking || !document.querySelector("[sse-connect]")) return;
    asking = true;
    var abort = new AbortController();
    setTimeout(function () { abort.abort(); }, 3000);  // a frozen control plane never answers
    fetch("/ui/alive", { cache: "no-store", credentials: "same-origin", signal: abort.signal })
      .then(function (r) {
        if (r.status === 401) {
          stale("Your session has ended: the control plane restarted, or it ran out.", true);
        } else if (Date.now() - heard > QUIET_MS) {
          stale("This page is not live: its updates stopped coming.", false);
        }
      })
      .catch(function () {
        stale("The control plane does not answer.", false);
      })
      .then(function () { asking = false; });
  }

  setInterval(function () { if (Date.now() - heard > QUIET_MS) check(); }, 1000);

  // The Playground: a chat streamed through the router (relayed by /ui/playground/chat),
  // with the replica that answered and the time to its first token.
  function say(box, role, text) {
    var line = document.createElement("div");
    line.className = "message " + role;
    line.textContent = text;
    box.appendChild(line);
    return line;
  }

  function playground() {
    var form = document.getElementById("playground");
    if (!form) return;
    var key = document.getElementById("key");
    var info = document.getElementById("answer-info");
    var box = document.getElementById("messages");
    var history = [];
    key.value = sessionStorage.getItem("playground-key") || "";
    key.addEventListener("change", function () {
      sessionStorage.setItem("playground-key", key.value);
    });
    document.getElementById("make-key").addEventListener("click", function () {
      var note = document.getElementById("key-note");
      var asked = new AbortController();
      var late = setTimeout(function () { asked.abort(); }, ALIVE_WAIT_MS * 5);
      fetch("/ui/playground/key", { method: "POST", credentials: "same-origin",
                                    signal: asked.signal })
        .then(function (r) { return r.json(); })
        .then(function (made) {
          if (!made.key) { note.textContent = made.error || "no key made"; return; }
          key.value = made.key;
          sessionStorage.setItem("playground-key", made.key);
          note.textContent = "made " + made.name + ", for " + made.expires + " (shown once)";
        })
        .catch(function () {
          note.textContent = "Cannot reach the fleet: the control plane does not answer";
        })
        .then(function () { clearTimeout(late); });
    });
    form.addEventListener("submit", async function (e) {
      e.preventDefault();
      var prompt = document.getElementById("prompt");
      if (!prompt.value) return;
      history.push({ role: "user", content: prompt.value });
      say(box, "user", prompt.value);
      prompt.value = "";
      var answer = say(box, "assistant", "");
      var sent = performance.now(), first = null, tokens = null;
      info.textContent = "asking ...";
      var chat = watched();
      try {
        var r = await fetch("/ui/playground/chat", {
          method: "POST",
          credentials: "same-origin",
          headers: { "content-type": "application/json" },
          body: JSON.stringify({ key: key.value, model: document.getElementById("model").value,
                                 messages: history, max_tokens: 256 }),
          signal: chat.signal
        });
        var replica = r.headers.get("x-modelfleet-replica") || "-";
        if (!r.ok) {
          var text = await r.text(), why = text, fleet = false;
          try {
            var got = JSON.parse(text);
            why = (got.error && got.error.message) || got.error;
            fleet = got.unreachable === true;  // the control plane's word: no router answered
          } catch (err) { /* not JSON: the text itself */ }
          history.pop();
          if (fleet) { unreachable(answer, why); return; }
          answer.classList.add("error");
          answer.textContent = r.status + ": " + why;
          info.textContent = "refused" + (r.headers.get("x-modelfleet-reason")
            ? " (" + r.headers.get("x-modelfleet-reason") + ")" : "");
          return;
        }
        var reader = r.body.getReader(), decoder = new TextDecoder(), held = "";
        for (;;) {
          chat.wait();  // each part of the answer within ANSWER_WAIT_MS of the one before
          var part = await reader.read();
          if (part.done) break;
          held += decoder.decode(part.value, { stream: true });
          var events = held.split("\n\n");
          held = events.pop();
          events.forEach(function (event) {
            event.split("\n").forEach(function (line) {
              if (!line.startsWith("data: ") || line === "data: [DONE]") return;
              var chunk = JSON.parse(line.slice(6));
              var delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
              if (delta && delta.content) {
                if (first === null) first = performance.now() - sent;
                answer.textContent += delta.content;
              }
              if (chunk.usage) tokens = chunk.usage.completion_tokens;
            });
          });
        }
      } catch (err) {
        // No answer came (the control plane is stopped, frozen or cut off), or it stopped
        // coming: said, instead of "asking ..." for ever.
        if (answer.textContent) history.push({ role: "assistant", content: answer.textContent });
        else history.pop();
        unreachable(answer, chat.why() || "the control plane does not answer");
        return;
      } finally {
        chat.done();
      }
      history.push({ role: "assistant", content: answer.textContent });
      info.textContent = "answered by " + replica +
        (first === null ? "" : " · first token after " + Math.round(first) + " ms") +
        (tokens === null ? "" : " · " + tokens + " tokens");
    });

    function unreachable(answer, why) {
      var line = answer.textContent ? say(box, "assistant", "") : answer;
      line.classList.add("error");
      line.textContent = "Cannot reach the fleet: " + why;
      info.textContent = "cannot reach the fleet";
    }
  }

  // A chat's watch: it is aborted when the control plane that relays it stops answering
  // (asked every ALIVE_EVERY_MS, ALIVE_WAIT_MS each: a frozen one never answers), or when
  // no part of its answer came for ANSWER_WAIT_MS (a model starting from zero is waited for).
  var ALIVE_EVERY_MS = 2000, ALIVE_WAIT_MS = 3000, ANSWER_WAIT_MS = 120000;
  function watched() {
    var abort = new AbortController(), reason = null, timer = null;
    function stop(why) {
      if (reason === null) { reason = why; abort.abort(); }
    }
    var probing = false;
    var probe = setInterval(function () {
      if (probing) return;
      probing = true;
      var asked = new AbortController();
      var late = setTimeout(function () { asked.abort(); }, ALIVE_WAIT_MS);
      fetch("/ui/alive", { cache: "no-store", credentials: "same-origin", signal: asked.signal })
        .catch(function () { stop("the control plane does not answer"); })
        .then(function () { clearTimeout(late); probing = false; });
    }, ALIVE_EVERY_MS);
    function wait() {
      clearTimeout(timer);
      timer = setTimeout(function () {
        stop("no answer came within " + ANSWER_WAIT_MS / 1000 + " s");
      }, ANSWER_WAIT_MS);
    }
    wait();
    return {
      signal: abort.signal,
      wait: wait,
      why: function () { return reason; },
      done: function () { clearInterval(probe); clearTimeout(timer); }
    };
  }

  document.addEventListener("DOMContentLoaded", function () { draw(document); playground(); });
  document.addEventListener("htmx:afterSettle", function (e) { draw(e.target); });
  document.addEventListener("htmx:sseOpen", live);
  document.addEventListener("htmx:sseError", check);
  document.addEventListener("htmx:sseMessage", function () {
    live();
    var log = document.getElementById("log");
    if (log) log.scrollTop = log.scrollHeight;
  });
})();
