#pragma once
// The page at GET /: a prompt box that calls POST /v1/images/generations from the browser
// and shows the images, with the framework's own fields at hand. Inline, so that the
// binary is the whole service.
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
  input { font: inherit; padding: .35rem .45rem; border: 1px solid #bbb; border-radius: 4px; }
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
<p>Model <b id="model">…</b>. Type a prompt; the images come from <code>POST /v1/images/generations</code>.</p>
<form id="form">
  <label id="prompt-label">Prompt <input id="prompt" required maxlength="1000" value="a red sandal on the right"></label>
  <label>Images (n) <input id="n" type="number" min="1" value="2"></label>
  <label>Candidates <input id="candidates" type="number" min="1" placeholder="model's"></label>
  <label>Seed <input id="seed" type="number" min="0" placeholder="random"></label>
  <label>Guidance scale <input id="guidance" type="number" min="0" step="0.5" placeholder="model's"></label>
  <label>Super-resolution <input id="superres" type="checkbox" checked></label>
  <label>API key <input id="key" type="password" placeholder="if the server has one"></label>
  <button id="go" type="submit">Generate</button>
</form>
<div id="status"></div>
<div id="images"></div>
<script>
const $ = (id) => document.getElementById(id);
fetch("/v1/models", { headers: authorization() }).then((r) => r.json())
  .then((list) => { $("model").textContent = list.data ? list.data[0].id : "(needs the API key)"; })
  .catch(() => { $("model").textContent = "(unreachable)"; });

function authorization() {
  const key = $("key") ? $("key").value : "";
  return key ? { Authorization: "Bearer " + key } : {};
}

function number(id) {
  const text = $(id).value.trim();
  return text === "" ? undefined : Number(text);
}

$("form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const body = { prompt: $("prompt").value, n: number("n"), response_format: "b64_json",
                 candidates: number("candidates"), seed: number("seed"), guidance_scale: number("guidance"),
                 superres: $("superres").checked };
  $("go").disabled = true;
  $("status").className = "";
  $("status").textContent = "Generating…";
  const started = performance.now();
  try {
    const response = await fetch("/v1/images/generations", {
      method: "POST", headers: { "Content-Type": "application/json", ...authorization() }, body: JSON.stringify(body) });
    const answer = await response.json();
    if (!response.ok) throw new Error(answer.error ? answer.error.message : response.statusText);
    $("images").replaceChildren(...answer.data.map((image, rank) => {
      const figure = document.createElement("figure");
      const picture = document.createElement("img");
      picture.src = "data:image/png;base64," + image.b64_json;
      picture.alt = body.prompt;
      const caption = document.createElement("figcaption");
      caption.textContent = "rank " + rank;
      figure.append(picture, caption);
      return figure;
    }));
    $("status").textContent = answer.data.length + " images in " + ((performance.now() - started) / 1000).toFixed(1) + " s";
  } catch (error) {
    $("status").className = "error";
    $("status").textContent = error.message;
  } finally {
    $("go").disabled = false;
  }
});
</script>
</body>
</html>
)html";

}  // namespace dalle::serve
