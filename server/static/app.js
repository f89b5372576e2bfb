// The page speaks the /v1/ API (the gRPC API as JSON). No framework, no build step, nothing fetched
// from outside: the server serves this file as it is.
"use strict";

const $ = (id) => document.getElementById(id);
const token = $("token");
token.value = localStorage.getItem("gret-serve-token") || "";
let models = [];

async function api(path, body) {
  const headers = {"Content-Type": "application/json"};
  if (token.value) headers.Authorization = `Bearer ${token.value}`;
  const response = await fetch(path, body ? {method: "POST", headers, body: JSON.stringify(body)} : {headers});
  const answer = await response.json();
  if (!response.ok) throw new Error(`${response.status} ${answer.code}: ${answer.error}`);
  return answer;
}

function show(message, error = false) {
  $("status").textContent = message;
  $("status").className = error ? "error" : "";
}

async function loadModels() {
  try {
    models = (await api("/v1/models")).models;
  } catch (error) {
    return show(`${error.message} (a token may be needed)`, true);
  }
  $("model").replaceChildren(...models.map((m) => {
    const label = m.task === "translate" ? `${m.source_language} → ${m.target_language}` : "summarise";
    return new Option(`${m.name} (${label}, ${m.architecture})`, m.name);
  }));
  pickModel();
  show("");
}

function chosen() {
  return models.find((m) => m.name === $("model").value);
}

function pickModel() {
  const model = chosen();
  if (!model) return;
  const gret = model.architecture.startsWith("GRET");  // the others have no context gate
  $("gate").disabled = !gret;
  $("gate").checked = gret;
  $("run").textContent = model.task === "translate" ? "Translate" : "Summarise";
}

// A gate value in (0, 1) as a shade of blue: dark where the piece leaned on the global state.
function gateStrip(values) {
  const strip = document.createElement("div");
  strip.className = "gate";
  strip.dataset.pieces = values.length;
  for (const [i, g] of values.entries()) {
    const piece = document.createElement("span");
    piece.className = "piece";
    piece.style.background = `rgba(29, 78, 216, ${g.toFixed(3)})`;
    piece.title = `piece ${i + 1}: gate ${g.toFixed(3)}`;
    strip.append(piece);
  }
  const legend = document.createElement("span");
  legend.className = "legend";
  legend.textContent = "context gate per output piece (light 0 … dark 1)";
  strip.append(legend);
  return strip;
}

function render(texts, response) {
  $("results").replaceChildren(...response.results.map((result) => {
    const box = document.createElement("article");
    box.className = "result";
    const source = document.createElement("p");
    source.className = "source";
    source.textContent = texts[result.index];
    const table = document.createElement("table");
    for (const [rank, h] of result.hypotheses.entries()) {
      const row = table.insertRow();
      row.className = rank === 0 ? "best" : "";
      row.insertCell().textContent = `${rank + 1}.`;
      row.insertCell().textContent = h.text;
      row.insertCell().textContent = `score ${h.score.toFixed(3)}`;
      [row.cells[0].className, row.cells[1].className, row.cells[2].className] = ["rank", "text", "score"];
    }
    box.append(source, table);
    if (result.diagnostics && result.diagnostics.gate.length) box.append(gateStrip(result.diagnostics.gate));
    return box;
  }));
}

$("request").addEventListener("submit", async (event) => {
  event.preventDefault();
  const model = chosen();
  const texts = $("texts").value.split("\n").map((t) => t.trim()).filter(Boolean);
  if (!model || !texts.length) return;
  localStorage.setItem("gret-serve-token", token.value);
  const options = {beam_size: +$("beam").value, n_best: +$("nbest").value, return_scores: true,
                   return_diagnostics: $("gate").checked};
  show("working…");
  $("run").disabled = true;
  try {
    render(texts, await api(`/v1/${model.task}`, {texts, model: model.name, options}));
    show("");
  } catch (error) {
    show(error.message, true);
  } finally {
    $("run").disabled = false;
  }
});

$("model").addEventListener("change", pickModel);
token.addEventListener("change", loadModels);
loadModels();
