#pragma once
// The page at GET /: a prompt box that submits a job (POST /v1/images/jobs) from the browser,
// follows it and shows the images as they are drawn, with the framework's own fields and the
// model's adapters at hand. The job's id is kept in the browser's storage, so that a reload
// (or a closed and reopened tab) finds the job again; the API key is kept for the tab's life
// (sessionStorage), so that the reloaded page can follow it. Inline, so that the binary is the
// whole service.
namespace dalle::serve {

inline constexpr const char* kWebPage = R"html(<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>dalle-serve</title>
<style>
  body { font: 15px system-ui, sans-serif; max-width: 56rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
  form { display: grid; grid-template-columns: repeat(auto-fill, minmax(9rem, 1fr)); gap: .6rem 1rem; align-items: end; }
  label { display: flex; flex-direction: column; font-size: 13px; color: #555; }
  #prompt-label { grid-column: 1 / -1; }
  input, select { font: inherit; padding: .35rem .45rem; border: 1px solid #bbb; border-radius: 4px; }
  button { font: inherit; padding: .45rem 1rem; border-radius: 4px; border: 0; background: #2456c4; color: #fff; cursor: pointer; }
  button:disabled { background: #999; cursor: wait; }
  #status { margin: 1rem 0; min-height: 1.2em; }
  #status.error { color: #b00020; }
  #images { display: flex; flex-wrap: wrap; gap: 1rem; }
  figure { margin: 0; font-size: 12px; color: #555; }
  figure img { display: block; width: 256px; height: 256px; image-rendering: pixelated; border: 1px solid #ddd; }
</style>
</head>
<body>
<h1>dalle-serve</h1>
<p>Model <b id="model">…</b>. Type a prompt; the images come from a job (<code>POST /v1/images/jobs</code>,
the asynchronous form of <code>POST /v1/images/generations</code>), which a reload of this page finds again.</p>
<form id="form">
  <label id="prompt-label">Prompt <input id="prompt" required maxlength="1000" value="a red sandal on the right"></label>
  <label>Images (n) <input id="n" type="number" min="1" value="2"></label>
  <label>Candidates <input id="candidates" type="number" min="1" placeholder="model's"></label>
  <label>Seed <input id="seed" type="number" min="0" placeholder="random"></label>
  <label>Guidance scale <input id="guidance" type="number" min="0" step="0.5" placeholder="model's"></label>
  <label>Super-resolution <input id="superres" type="checkbox" checked></label>
  <label id="adapter-label" hidden>Adapter <select id="adapter"><option value="">none</option></select></label>
  <label>API key <input id="key" type="password" placeholder="if the server has one"></label>
  <button id="go" type="submit">Generate</button>
  <button id="cancel" type="button" hidden>Cancel</button>
</form>
<div id="status"></div>
<div id="images"></div>
<script>
const $ = (id) => document.getElementById(id);
const kKeyKey = "dalle-serve-key";
let wantedAdapter = "";  // a restored job's adapter, chosen once the model's adapters are listed
if (sessionStorage.getItem(kKeyKey)) $("key").value = sessionStorage.getItem(kKeyKey);

// The model's name and the adapters a request may choose, once the key lets us read them.
function showModel() {
  fetch("/v1/models", { headers: authorization() }).then((r) => r.json())
    .then((list) => {
      const model = list.data ? list.data[0] : null;
      $("model").textContent = model ? model.id : "(needs the API key)";
      const adapters = model && model.adapters ? model.adapters : [];
      $("adapter").replaceChildren(...["", ...adapters].map((name) => {
        const option = document.createElement("option");
        option.value = name;
        option.textContent = name || "none";
        return option;
      }));
      $("adapter-label").hidden = adapters.length === 0;
      if (adapters.includes(wantedAdapter)) $("adapter").value = wantedAdapter;
    })
    .catch(() => { $("model").textContent = "(unreachable)"; });
}
showModel();
$("key").addEventListener("change", () => {
  sessionStorage.setItem(kKeyKey, $("key").value);
  showModel();
});

function authorization() {
  const key = $("key") ? $("key").value : "";
  return key ? { Authorization: "Bearer " + key } : {};
}

function number(id) {
  const text = $(id).value.trim();
  return text === "" ? undefined : Number(text);
}

const kJobKey = "dalle-serve-job";
const kFormFields = ["prompt", "n", "candidates", "seed", "guidance"];

// The form as typed, kept with the job, so that a reload shows what is being drawn.
function formFields() {
  const form = { superres: $("superres").checked, adapter: $("adapter").value };
  for (const id of kFormFields) form[id] = $(id).value;
  return form;
}

function restoreForm(form) {
  for (const id of kFormFields) if (form[id] !== undefined) $(id).value = form[id];
  if (form.superres !== undefined) $("superres").checked = form.superres;
  wantedAdapter = form.adapter || "";
  $("adapter").value = wantedAdapter;
}

function show(status, error) {
  $("status").className = error ? "error" : "";
  $("status").textContent = status;
}

function busy(on) {
  $("go").disabled = on;
  $("cancel").hidden = !on;
}

// An answer's images, or a running job's partial images (`drawing`).
function showImages(data, prompt, drawing) {
  $("images").replaceChildren(...data.map((image) => {
    const figure = document.createElement("figure");
    const picture = document.createElement("img");
    picture.src = image.url || "data:image/png;base64," + image.b64_json;
    picture.alt = prompt;
    const caption = document.createElement("figcaption");
    caption.textContent = drawing ? prompt + " (being drawn: candidate " + image.candidate + ")"
                                  : prompt + " (seed " + image.seed + ", candidate " + image.candidate + ")";
    figure.append(picture, caption);
    return figure;
  }));
}

// Follows the stored job until it ends; the job lives on the server, so this may start
// again after a reload.
async function follow() {
  const stored = JSON.parse(localStorage.getItem(kJobKey) || "null");
  if (!stored) return;
  restoreForm(stored.form || { prompt: stored.prompt });  // a reload shows what is being drawn
  busy(true);
  try {
    while (true) {
      const response = await fetch("/v1/images/jobs/" + stored.id, { headers: authorization() });
      const job = await response.json();
      if (!response.ok) throw new Error(job.error ? job.error.message : response.statusText);
      if (job.status === "queued") show("Queued (" + job.queue_position + " ahead)…");
      else if (job.status === "in_progress") {
        show("Generating…");
        if (job.partial_images) showImages(job.partial_images, stored.prompt, true);
      }
      else if (job.status === "succeeded") {
        showImages(job.result.data, stored.prompt);
        show(job.result.data.length + " images in " + ((Date.now() - stored.started) / 1000).toFixed(1) + " s");
        break;
      } else throw new Error(job.status === "failed" ? job.error.message : "The job was cancelled.");
      await new Promise((done) => setTimeout(done, 500));
    }
  } catch (error) {
    show(error.message, true);
  } finally {
    localStorage.removeItem(kJobKey);
    busy(false);
  }
}

$("form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const body = { prompt: $("prompt").value, n: number("n"), response_format: "b64_json",
                 candidates: number("candidates"), seed: number("seed"), guidance_scale: number("guidance"),
                 superres: $("superres").checked, partial_images: 3,
                 adapters: $("adapter").value ? { [$("adapter").value]: 1 } : undefined };
  show("Submitting…");
  try {
    const response = await fetch("/v1/images/jobs", {
      method: "POST", headers: { "Content-Type": "application/json", ...authorization() }, body: JSON.stringify(body) });
    const job = await response.json();
    if (!response.ok) throw new Error(job.error ? job.error.message : response.statusText);
    localStorage.setItem(kJobKey, JSON.stringify({ id: job.id, prompt: body.prompt, form: formFields(),
                                                   started: Date.now() }));
    follow();
  } catch (error) {
    show(error.message, true);
  }
});

$("cancel").addEventListener("click", () => {
  const stored = JSON.parse(localStorage.getItem(kJobKey) || "null");
  if (stored) fetch("/v1/images/jobs/" + stored.id, { method: "DELETE", headers: authorization() });
});

follow();
</script>
</body>
</html>
)html";

}  // namespace dalle::serve
