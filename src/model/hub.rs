//! Where `--model NAME` points: a preset, a path, or a model that another tool already put on
//! this machine. Nothing is downloaded; a name resolves to files that are here, or to an error
//! that lists every place it looked.
//!
//! - `PATH`: a model folder or a GGUF file, as given.
//! - `org/name[:TAG][@REVISION]`: the Hugging Face hub cache (`$HF_HUB_CACHE`, else
//!   `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`),
//!   in its own layout: `models--org--name/refs/REVISION` names the snapshot (`main` by
//!   default; a commit hash names `snapshots/HASH` directly). A snapshot with a `config.json` is
//!   a model folder; otherwise its one `.gguf` file, or the one whose name contains `TAG`
//!   (e.g. `:Q4_K_M`) when it holds several.
//! - `ollama:name[:tag]`: Ollama's store (`$OLLAMA_MODELS`, else `~/.ollama/models`, else the
//!   Linux service's `/usr/share/ollama/.ollama/models`): the manifest
//!   `manifests/HOST/NAMESPACE/name/tag` (`library` and `latest` by default) names the GGUF blob
//!   of its model layer.

use std::fmt;
use std::path::{Path, PathBuf};

use thiserror::Error;

use super::config::PRESETS;
use super::gguf::is_gguf;

/// A `--model` name that resolves nowhere, or to something that is not a model.
#[derive(Debug, Error)]
pub enum HubError {
    /// Nothing by that name in any place wgpar looks.
    #[error(
        "no model '{name}': --model takes a preset ({presets}), a model folder or GGUF file, \
         org/name from the Hugging Face cache or ollama:name; looked at: {looked}",
        presets = PRESETS.join(", "),
        looked = looked.join("; ")
    )]
    NotFound {
        /// The name as given.
        name: String,
        /// Each place looked at, with what was missing there.
        looked: Vec<String>,
    },
    /// The cached repository holds several GGUF files and the name does not pick one.
    #[error(
        "'{name}' holds {} GGUF files ({}): add ':TAG' to pick one (e.g. '{name}:Q4_K_M'), or \
         pass the file's path",
        files.len(),
        files.join(", ")
    )]
    Ambiguous {
        /// The name as given.
        name: String,
        /// The candidate files, relative to the snapshot.
        files: Vec<String>,
    },
    /// A file found where a model was expected is not one (an unreadable manifest, a blob that
    /// is not GGUF).
    #[error("'{name}': {path}: {detail}")]
    Invalid {
        /// The name as given.
        name: String,
        /// The file at fault.
        path: PathBuf,
        /// What is wrong with it.
        detail: String,
    },
}

/// What `--model` named: a preset (synthetic weights) or files on this machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelRef {
    /// A preset's name.
    Preset(String),
    /// A model folder or GGUF file, with the name it was found by.
    Local {
        /// The name as given (a path, `org/name` or `ollama:name`).
        name: String,
        /// The folder or file.
        path: PathBuf,
    },
}

impl ModelRef {
    /// Resolves `name` in the places this process's environment names.
    pub fn resolve(name: &str) -> Result<Self, HubError> {
        Self::resolve_in(name, &Places::from_env())
    }

    /// Resolves `name` in `places`: an existing path first, then a preset, then Ollama's store
    /// (`ollama:` names), then the Hugging Face cache (`org/name` names).
    pub fn resolve_in(name: &str, places: &Places) -> Result<Self, HubError> {
        let local = |path: PathBuf| {
            Ok(Self::Local {
                name: name.to_string(),
                path,
            })
        };
        let given = Path::new(name);
        if given.is_dir() || is_gguf(given) {
            return local(given.to_path_buf());
        }
        if PRESETS.contains(&name) {
            return Ok(Self::Preset(name.to_string()));
        }
        let mut looked = vec![format!("{name}: no such folder or GGUF file")];
        if let Some(rest) = name.strip_prefix("ollama:") {
            return ollama(name, rest, places, &mut looked).and_then(local);
        }
        if let Some(repo) = HubName::parse(name) {
            return hub_cache(name, &repo, places, &mut looked).and_then(local);
        }
        Err(HubError::NotFound {
            name: name.to_string(),
            looked,
        })
    }

    /// The folder or file, where the name is not a preset.
    pub fn path(&self) -> Option<&Path> {
        match self {
            Self::Preset(_) => None,
            Self::Local { path, .. } => Some(path),
        }
    }

    /// The name as given.
    pub fn name(&self) -> &str {
        match self {
            Self::Preset(name) | Self::Local { name, .. } => name,
        }
    }
}

impl fmt::Display for ModelRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The stores a name is looked up in.
#[derive(Clone, Debug, Default)]
pub struct Places {
    /// The Hugging Face hub cache folder (the one holding `models--org--name`).
    pub hf_cache: Option<PathBuf>,
    /// Ollama's model folders (each holding `manifests/` and `blobs/`), in order.
    pub ollama: Vec<PathBuf>,
}

impl Places {
    /// The places the environment names, with the tools' own defaults.
    pub fn from_env() -> Self {
        let var = |k: &str| {
            std::env::var_os(k)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        let home = var("HOME");
        let hf_cache = var("HF_HUB_CACHE")
            .or_else(|| var("HF_HOME").map(|h| h.join("hub")))
            .or_else(|| var("XDG_CACHE_HOME").map(|c| c.join("huggingface/hub")))
            .or_else(|| home.as_ref().map(|h| h.join(".cache/huggingface/hub")));
        let ollama = match var("OLLAMA_MODELS") {
            Some(dir) => vec![dir],
            None => home
                .iter()
                .map(|h| h.join(".ollama/models"))
                .chain([PathBuf::from("/usr/share/ollama/.ollama/models")])
                .collect(),
        };
        Self { hf_cache, ollama }
    }
}

/// `org/name[:TAG][@REVISION]`, split.
#[derive(Debug, PartialEq, Eq)]
struct HubName<'a> {
    org: &'a str,
    repo: &'a str,
    tag: Option<&'a str>,
    revision: &'a str,
}

impl<'a> HubName<'a> {
    fn parse(name: &'a str) -> Option<Self> {
        let (rest, revision) = name.rsplit_once('@').unwrap_or((name, "main"));
        let (rest, tag) = match rest.split_once(':') {
            Some((r, t)) => (r, Some(t)),
            None => (rest, None),
        };
        let (org, repo) = rest.split_once('/')?;
        let part_ok = |s: &str| {
            !s.is_empty()
                && !s.starts_with('.')
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        };
        let ok = part_ok(org)
            && part_ok(repo)
            && tag.is_none_or(part_ok)
            && part_ok(revision)
            && !revision.contains('/');
        ok.then_some(Self {
            org,
            repo,
            tag,
            revision,
        })
    }
}

/// The snapshot folder (or its GGUF file) that `repo` names in the hub cache.
fn hub_cache(
    name: &str,
    repo: &HubName,
    places: &Places,
    looked: &mut Vec<String>,
) -> Result<PathBuf, HubError> {
    let not_found = |looked: &mut Vec<String>| HubError::NotFound {
        name: name.to_string(),
        looked: std::mem::take(looked),
    };
    let Some(cache) = &places.hf_cache else {
        looked.push("the Hugging Face cache: no HF_HUB_CACHE, HF_HOME or HOME set".into());
        return Err(not_found(looked));
    };
    let folder = cache.join(format!("models--{}--{}", repo.org, repo.repo));
    if !folder.is_dir() {
        looked.push(format!(
            "{}: not in the Hugging Face cache",
            folder.display()
        ));
        return Err(not_found(looked));
    }
    let Some(snapshot) = snapshot(&folder, repo.revision) else {
        looked.push(format!(
            "{}: no ref or snapshot '{}'",
            folder.display(),
            repo.revision
        ));
        return Err(not_found(looked));
    };
    if snapshot.join("config.json").is_file() && repo.tag.is_none() {
        return Ok(snapshot);
    }
    gguf_in_snapshot(name, &snapshot, repo.tag, looked)
}

/// `refs/REVISION`'s commit, else a snapshot named `REVISION` (a commit hash).
fn snapshot(folder: &Path, revision: &str) -> Option<PathBuf> {
    let by_ref = std::fs::read_to_string(folder.join("refs").join(revision))
        .ok()
        .map(|hash| folder.join("snapshots").join(hash.trim()));
    let by_hash = folder.join("snapshots").join(revision);
    by_ref
        .into_iter()
        .chain([by_hash])
        .find(|path| path.is_dir())
}

/// The snapshot's one GGUF file (in it or one folder down), or the one whose name contains
/// `tag` (case-insensitively). Multimodal projectors (`mmproj`) are not models.
fn gguf_in_snapshot(
    name: &str,
    snapshot: &Path,
    tag: Option<&str>,
    looked: &mut Vec<String>,
) -> Result<PathBuf, HubError> {
    let wanted = |rel: &str| {
        let lower = rel.to_ascii_lowercase();
        lower.ends_with(".gguf")
            && !lower.contains("mmproj")
            && tag.is_none_or(|t| lower.contains(&t.to_ascii_lowercase()))
    };
    let mut files: Vec<String> = files_two_deep(snapshot)
        .into_iter()
        .filter(|rel| wanted(rel))
        .collect();
    files.sort();
    match files.len() {
        1 => Ok(snapshot.join(&files[0])),
        0 => {
            looked.push(format!(
                "{}: no config.json and no GGUF file{}",
                snapshot.display(),
                tag.map(|t| format!(" matching '{t}'")).unwrap_or_default()
            ));
            Err(HubError::NotFound {
                name: name.to_string(),
                looked: std::mem::take(looked),
            })
        }
        _ => Err(HubError::Ambiguous {
            name: name.to_string(),
            files,
        }),
    }
}

/// Paths relative to `dir` of its files and of its subfolders' files (snapshot entries are
/// symbolic links into `blobs/`, which `is_file` follows).
fn files_two_deep(dir: &Path) -> Vec<String> {
    let entries = |d: &Path| -> Vec<(String, PathBuf)> {
        std::fs::read_dir(d)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
            .collect()
    };
    let mut out = Vec::new();
    for (name, path) in entries(dir) {
        if path.is_dir() {
            out.extend(
                entries(&path)
                    .into_iter()
                    .filter(|(_, p)| p.is_file())
                    .map(|(inner, _)| format!("{name}/{inner}")),
            );
        } else if path.is_file() {
            out.push(name);
        }
    }
    out
}

/// The GGUF blob of `ollama:name[:tag]`'s model layer.
fn ollama(
    name: &str,
    rest: &str,
    places: &Places,
    looked: &mut Vec<String>,
) -> Result<PathBuf, HubError> {
    let (model, tag) = rest.rsplit_once(':').unwrap_or((rest, "latest"));
    let (namespace, model) = model.rsplit_once('/').unwrap_or(("library", model));
    for store in &places.ollama {
        let hosts = std::fs::read_dir(store.join("manifests"))
            .into_iter()
            .flatten()
            .flatten();
        for host in hosts {
            let manifest = host.path().join(namespace).join(model).join(tag);
            if manifest.is_file() {
                return model_blob(name, store, &manifest);
            }
        }
        looked.push(format!(
            "{}: no manifest {namespace}/{model}/{tag}",
            store.join("manifests").display()
        ));
    }
    Err(HubError::NotFound {
        name: name.to_string(),
        looked: std::mem::take(looked),
    })
}

/// The blob that an Ollama manifest's model layer names, checked to be a GGUF file.
fn model_blob(name: &str, store: &Path, manifest: &Path) -> Result<PathBuf, HubError> {
    let invalid = |path: &Path, detail: String| HubError::Invalid {
        name: name.to_string(),
        path: path.to_path_buf(),
        detail,
    };
    let text = std::fs::read_to_string(manifest).map_err(|e| invalid(manifest, e.to_string()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| invalid(manifest, e.to_string()))?;
    let layers = json["layers"].as_array().cloned().unwrap_or_default();
    let digest = layers
        .iter()
        .find(|l| l["mediaType"] == "application/vnd.ollama.image.model")
        .and_then(|l| l["digest"].as_str())
        .ok_or_else(|| invalid(manifest, "no model layer".into()))?;
    let blobs = store.join("blobs");
    // Newer stores name blobs `sha256-HEX`, older ones `sha256:HEX`.
    let blob = [digest.replacen(':', "-", 1), digest.to_string()]
        .iter()
        .map(|file| blobs.join(file))
        .find(|p| p.is_file())
        .ok_or_else(|| invalid(manifest, format!("its model blob {digest} is missing")))?;
    if !is_gguf(&blob) {
        return Err(invalid(&blob, "the model layer is not a GGUF file".into()));
    }
    Ok(blob)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_names_parse() {
        let n = HubName::parse("HuggingFaceTB/SmolLM2-135M:Q4_K_M@v1.0").unwrap();
        assert_eq!(
            (n.org, n.repo, n.tag, n.revision),
            ("HuggingFaceTB", "SmolLM2-135M", Some("Q4_K_M"), "v1.0")
        );
        let n = HubName::parse("org/name").unwrap();
        assert_eq!((n.tag, n.revision), (None, "main"));
        for bad in ["name", "a/b/c", "../x", "org/", "/abs", "org/n@", "org/n:"] {
            assert!(HubName::parse(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn unknown_names_list_where_they_were_looked_for() {
        let places = Places {
            hf_cache: Some(PathBuf::from("/nonexistent-hf")),
            ollama: vec![PathBuf::from("/nonexistent-ollama")],
        };
        let e = ModelRef::resolve_in("org/none", &places)
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent-hf/models--org--none"), "{e}");
        let e = ModelRef::resolve_in("ollama:none", &places)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/nonexistent-ollama/manifests: no manifest library/none/latest"),
            "{e}"
        );
        let e = ModelRef::resolve_in("nothing", &places)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("a preset (default,") && e.contains("model folder"),
            "{e}"
        );
        assert_eq!(
            ModelRef::resolve_in("tiny-llama", &places).unwrap(),
            ModelRef::Preset("tiny-llama".into())
        );
    }
}
