//! File helpers shared by the commands: JSON in with errors that name the file, JSON out written atomically
//! (a crash never leaves a half-written result where a good one was).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Reads and parses a JSON file; the error names the file and the problem.
pub fn read_json<T: DeserializeOwned>(path: &Path) -> anyhow::Result<T> {
    Ok(read_json_and_text(path)?.0)
}

/// [`read_json`], with the text it was read from (for a fingerprint of the file, without reading it twice).
pub fn read_json_and_text<T: DeserializeOwned>(path: &Path) -> anyhow::Result<(T, String)> {
    parse_json_file(path, None)
}

/// [`read_json_and_text`] whose error for a file that reads but does not parse says what it should hold
/// (`expected`); a file that cannot be read says only that.
pub fn read_json_expecting<T: DeserializeOwned>(
    path: &Path,
    expected: &str,
) -> anyhow::Result<(T, String)> {
    parse_json_file(path, Some(expected))
}

fn parse_json_file<T: DeserializeOwned>(
    path: &Path,
    expected: Option<&str>,
) -> anyhow::Result<(T, String)> {
    let text = std::fs::read_to_string(path).map_err(failed(path, "cannot read"))?;
    let value = serde_json::from_str(&text).with_context(|| {
        let expected = expected.map_or(String::new(), |e| format!(" (expected {e})"));
        format!("{}: invalid content{expected}", path.display())
    })?;
    Ok((value, text))
}

/// The first key of the JSON document `json` that appears twice in one object, at any depth, as its dotted
/// path (`seed`, `train.lr`), if any: serde_json's map keeps one value per key (the last), so a repeated key
/// is an ambiguity its readers would never see.
pub fn first_repeated_key(json: &[u8]) -> Result<Option<String>, serde_json::Error> {
    /// A JSON value read for its repeated keys alone: the first one's path.
    struct Repeated(Option<String>);
    impl<'de> serde::Deserialize<'de> for Repeated {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_any(Visit)
        }
    }
    struct Visit;
    impl<'de> serde::de::Visitor<'de> for Visit {
        type Value = Repeated;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON value")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Repeated, A::Error> {
            let mut seen = std::collections::HashSet::new();
            let mut repeated = None;
            while let Some(key) = map.next_key::<String>()? {
                let inner = map.next_value::<Repeated>()?.0;
                if repeated.is_none() {
                    repeated = inner.map(|k| format!("{key}.{k}"));
                }
                if !seen.insert(key.clone()) && repeated.is_none() {
                    repeated = Some(key);
                }
            }
            Ok(Repeated(repeated))
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Repeated, A::Error> {
            let mut repeated = None;
            let mut i = 0usize;
            while let Some(inner) = seq.next_element::<Repeated>()? {
                if repeated.is_none() {
                    repeated = inner.0.map(|k| format!("[{i}].{k}"));
                }
                i += 1;
            }
            Ok(Repeated(repeated))
        }
        fn visit_bool<E>(self, _: bool) -> Result<Repeated, E> {
            Ok(Repeated(None))
        }
        fn visit_i64<E>(self, _: i64) -> Result<Repeated, E> {
            Ok(Repeated(None))
        }
        fn visit_u64<E>(self, _: u64) -> Result<Repeated, E> {
            Ok(Repeated(None))
        }
        fn visit_f64<E>(self, _: f64) -> Result<Repeated, E> {
            Ok(Repeated(None))
        }
        fn visit_str<E>(self, _: &str) -> Result<Repeated, E> {
            Ok(Repeated(None))
        }
        fn visit_unit<E>(self) -> Result<Repeated, E> {
            Ok(Repeated(None))
        }
    }
    serde_json::from_slice::<Repeated>(json).map(|k| k.0)
}

/// Gives a file or directory written under a temporary name the permissions of an ordinary new one (0644,
/// directories 0755: temporary files are created 0600 and temporary directories 0700, which would make every
/// result private to its writer). Best effort: a file system without Unix permissions keeps what it has.
pub fn set_usual_permissions(path: &Path) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = if path.is_dir() { 0o755 } else { 0o644 };
        let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode));
    }
    #[cfg(not(unix))]
    let _ = path;
}

/// Writes `value` as JSON to `path` through a temporary file in the same directory, fsync and rename,
/// streamed (a score file of full-vocabulary logits is never held twice in memory).
pub fn write_json_atomic<T: Serialize>(path: &Path, value: &T) -> anyhow::Result<()> {
    write_through_temp(path, |file| {
        let mut w = std::io::BufWriter::new(file);
        serde_json::to_writer(&mut w, value)?;
        w.flush()
    })
}

/// Checks, before any work, that a file can be written at `path` later (by [`write_atomic`] and its kin):
/// nothing but a regular file there (a folder, or a device, pipe or socket the write would replace), and
/// the nearest part of its folder that exists is a folder a file can be created in. An evaluation or a
/// benchmark would otherwise run to its end and only then fail to save what it computed.
pub fn check_output_file(path: &Path) -> anyhow::Result<()> {
    if path.is_dir() {
        anyhow::bail!(
            "{}: is a folder; give the path of a file to write",
            path.display()
        );
    }
    refuse_special_file(path)?;
    let existing = path
        .ancestors()
        .skip(1)
        .filter(|d| !d.as_os_str().is_empty())
        .find(|d| d.symlink_metadata().is_ok());
    if let Some(dir) = existing.filter(|d| !d.is_dir()) {
        anyhow::bail!(
            "{}: cannot be written, since {} is not a folder",
            path.display(),
            dir.display()
        );
    }
    // A file made and removed at once: whether this process may create files there (permissions, a
    // read-only or virtual file system) is only known by trying.
    let dir = existing.unwrap_or(Path::new("."));
    if let Err(e) = tempfile::NamedTempFile::new_in(dir) {
        anyhow::bail!(
            "{}: cannot be written: no file can be created in {} ({e})",
            path.display(),
            dir.display()
        );
    }
    Ok(())
}

/// Refuses a `path` that exists and is neither a regular file nor a folder (a device, a pipe, a socket;
/// links followed): results are written to a temporary file that is then renamed over `path`, which would
/// replace `/dev/null` with a file of results.
fn refuse_special_file(path: &Path) -> anyhow::Result<()> {
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() && !m.is_dir() => anyhow::bail!(
            "{}: is not a regular file (a device, a pipe or a socket), which writing the results would \
             replace; give the path of a file to write",
            path.display()
        ),
        _ => Ok(()),
    }
}

/// Refuses, before any work, an output that names a file the command reads (`inputs`: its data, its
/// prompt ids, the files of its model directory). Results are written atomically over whatever is there,
/// so the input would be replaced by them: an evaluation's `--output` naming its data file, or the
/// model's `config.json`, used to exit 0 with the data or the model gone.
pub fn check_output_not_input(output: &Path, inputs: &[PathBuf]) -> anyhow::Result<()> {
    let Ok(out) = output.canonicalize() else {
        // Nothing there yet: it is no existing input.
        return Ok(());
    };
    if let Some(input) = inputs
        .iter()
        .find(|i| i.canonicalize().is_ok_and(|i| i == out))
    {
        anyhow::bail!(
            "{}: is also what this command reads ({}); writing the results there would replace it: give \
             another output path",
            output.display(),
            input.display()
        );
    }
    Ok(())
}

/// Removes those of `files` that are there (a run's finished marker, its plots), naming a file that
/// cannot be removed.
pub fn remove_files_present(files: impl IntoIterator<Item = PathBuf>) -> anyhow::Result<()> {
    for f in files.into_iter().filter(|f| f.is_file()) {
        std::fs::remove_file(&f).with_context(|| format!("{}: cannot remove", f.display()))?;
    }
    Ok(())
}

/// Writes `bytes` to `path` the same way (`write_through_temp`).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    write_through_temp(path, |file| file.write_all(bytes))
}

/// Creates `path`'s directory if need be, lets `write` fill a temporary file in it, then fsyncs and
/// renames it onto `path`: a crash or a full disk leaves either the previous file or the complete new
/// one, never half of it. Errors name the file. Nothing is written after a device failure
/// ([`crate::device_failures::check`]).
fn write_through_temp(
    path: &Path,
    write: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>,
) -> anyhow::Result<()> {
    crate::device_failures::check().with_context(|| format!("{}: not written", path.display()))?;
    refuse_special_file(path)?;
    let dir = folder_of(path);
    std::fs::create_dir_all(dir).map_err(failed(dir, "cannot create the directory"))?;
    let mut tmp = temp_file_for(path)?;
    write(tmp.as_file_mut())
        .and_then(|()| tmp.as_file().sync_all())
        .map_err(failed(path, "cannot write"))?;
    set_usual_permissions(tmp.path());
    tmp.persist(path)
        .map_err(|e| failed(path, "cannot move the result into place")(e.error))?;
    sync_dir(dir);
    Ok(())
}

/// Fsyncs directory `dir`, so that a rename into it survives a power loss (the file's own fsync does not
/// make its new name durable on every file system). Best effort: a file system that cannot fsync a
/// directory still has the renamed file, as ext4's ordered journal usually keeps it.
pub fn sync_dir(dir: &Path) {
    if let Ok(f) = std::fs::File::open(dir) {
        let _ = f.sync_all();
    }
}

/// Writes safetensors `(name, dtype, shape, bytes)` to `path` through a temporary file in the same
/// directory, fsync and rename: a crash leaves either the previous file or the complete new one.
/// Nothing is written after a device failure ([`crate::device_failures::check`]).
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, safetensors::Dtype, Vec<usize>, &[u8])],
) -> anyhow::Result<()> {
    write_safetensors_with_metadata(path, tensors, None)
}

/// [`write_safetensors`] with the header's `__metadata__` (string pairs), where the file itself must say
/// what its bytes are (a quantized checkpoint's format).
pub fn write_safetensors_with_metadata(
    path: &Path,
    tensors: &[(String, safetensors::Dtype, Vec<usize>, &[u8])],
    metadata: Option<std::collections::HashMap<String, String>>,
) -> anyhow::Result<()> {
    crate::device_failures::check().with_context(|| format!("{}: not written", path.display()))?;
    refuse_special_file(path)?;
    // The safetensors crate indexes out of bounds on a repeated name instead of refusing it.
    let mut names = std::collections::HashSet::new();
    if let Some((dup, ..)) = tensors.iter().find(|(n, ..)| !names.insert(n.as_str())) {
        anyhow::bail!(
            "{}: not written: tensor `{dup}` would be in it twice",
            path.display()
        );
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            Ok((
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b)?,
            ))
        })
        .collect::<Result<_, safetensors::SafeTensorError>>()
        .with_context(|| format!("{}: inconsistent tensor", path.display()))?;
    // serialize_to_file writes its own temporary file beside the name it is given: inside a temporary
    // directory of ours, so that a kill leaves nothing a later write cannot recognize and remove.
    let space = temp_dir_for(path)?;
    let tmp = space.path().join("tensors");
    safetensors::serialize_to_file(views, metadata, &tmp).map_err(|e| match e {
        safetensors::SafeTensorError::IoError(io) => failed(path, "cannot write")(io),
        other => anyhow::anyhow!("{}: cannot write ({other})", path.display()),
    })?;
    std::fs::File::open(&tmp)
        .and_then(|f| f.sync_all())
        .map_err(failed(path, "cannot write"))?;
    set_usual_permissions(&tmp);
    std::fs::rename(&tmp, path).map_err(failed(path, "cannot move into place"))?;
    sync_dir(folder_of(path));
    Ok(())
}

/// Whether `a` and `b` name the same directory: the same path once `.` and `..` are resolved
/// (through the file system where both exist, so links count too).
pub fn same_dir(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => {
            std::path::absolute(a).ok().map(|p| normal(&p))
                == std::path::absolute(b).ok().map(|p| normal(&p))
        }
    }
}

/// Whether `path` is `dir` or lies inside it, links resolved as far as the path exists (a model directory
/// under a run's `checkpoints/`, which `--overwrite` deletes).
pub fn within(path: &Path, dir: &Path) -> bool {
    resolved(path).starts_with(resolved(dir))
}

/// `p` made absolute with its longest existing prefix resolved through the file system (links followed,
/// and `..` after a link taken from the link's target, as the file system takes it) and the rest, which
/// holds no link, taken lexically.
fn resolved(p: &Path) -> std::path::PathBuf {
    let Ok(abs) = std::path::absolute(p) else {
        return p.to_path_buf();
    };
    let mut existing = abs.as_path();
    loop {
        if let Ok(real) = existing.canonicalize() {
            let rest = abs.strip_prefix(existing).unwrap_or(Path::new(""));
            return normal(&real.join(rest));
        }
        match existing.parent() {
            Some(parent) => existing = parent,
            None => return normal(&abs),
        }
    }
}

/// `p` without `.` components and with each `..` taking its parent away (lexically).
fn normal(p: &Path) -> std::path::PathBuf {
    use std::path::Component;
    let mut out = std::path::PathBuf::new();
    for c in p.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other.as_os_str()),
        }
    }
    out
}

/// Whether an optional input file is there: `Ok(false)` where nothing is at `path`, `Ok(true)` for a file
/// (or a link to one), and otherwise what is there instead ("is a directory", "is a link to nothing"):
/// "no tokenizer.json" would be wrong about a `tokenizer.json` that is a directory.
pub fn optional_file(path: &Path) -> Result<bool, &'static str> {
    use std::io::ErrorKind;
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::NotADirectory) => {
            return Ok(false)
        }
        Err(e) if e.kind() == ErrorKind::PermissionDenied => {
            return Err("cannot be examined (permission denied)")
        }
        Err(_) => return Err("cannot be examined"),
    };
    if path.is_file() {
        Ok(true)
    } else if path.is_dir() {
        Err("is a directory")
    } else if meta.file_type().is_symlink() && !path.exists() {
        Err("is a link to nothing")
    } else {
        Err("is not a regular file")
    }
}

/// Whether `path` is a directory that holds anything: an output that must not mix new files with its
/// own (a model directory), for the commands that write one.
pub fn occupied_dir(path: &Path) -> anyhow::Result<bool> {
    Ok(path.is_dir()
        && std::fs::read_dir(path)
            .map_err(failed(path, "cannot list"))?
            .next()
            .is_some())
}

/// Writes the directory `dst` through a temporary sibling that `fill` writes into: when `fill` fails, the
/// temporary directory is removed and `dst` is as it was; when it succeeds, the temporary directory is
/// renamed to `dst`. A `dst` that exists must be an empty directory, checked before `fill` runs: new files
/// beside another model's (shards, an index, a tokenizer not rewritten) would make a directory that loads
/// as neither.
pub fn write_dir_atomic<T>(
    dst: &Path,
    fill: impl FnOnce(&Path) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    if dst.exists() && !dst.is_dir() {
        anyhow::bail!("{}: exists and is not a directory", dst.display());
    }
    if occupied_dir(dst)? {
        anyhow::bail!(
            "{}: exists and is not empty; the new files would mix with its own (choose a new directory, \
             or remove this one first)",
            dst.display()
        );
    }
    let parent = folder_of(dst);
    std::fs::create_dir_all(parent)
        .with_context(|| format!("{}: cannot create the directory", parent.display()))?;
    let tmp = temp_dir_for(dst)?;
    let out = fill(tmp.path())?;
    set_usual_permissions(tmp.path());
    if dst.exists() {
        // Still empty (checked again: something may have written there meanwhile), so it can go.
        if occupied_dir(dst)? {
            anyhow::bail!(
                "{}: files appeared there while this ran; the new files were not moved in",
                dst.display()
            );
        }
        std::fs::remove_dir(dst).map_err(failed(dst, "cannot replace the empty directory"))?;
    }
    let kept = tmp.keep();
    std::fs::rename(&kept, dst)
        .with_context(|| format!("{}: cannot move the result into place", dst.display()))?;
    sync_dir(parent);
    Ok(out)
}

/// The start of the name of every temporary file or directory written for `name`, with this process's
/// id: `.{name}.partial-{pid}-`. A kill leaves such an entry behind (a model directory's worth of bytes for
/// `qarl quantize`); the next write of the same name removes those whose process is gone
/// ([`remove_stale_temporaries`]).
fn temp_prefix(name: &str) -> String {
    format!(".{name}.partial-{}-", std::process::id())
}

/// The file name `path` ends in, for `temp_prefix`.
fn name_of(path: &Path) -> String {
    path.file_name()
        .map_or("output".into(), |n| n.to_string_lossy().to_string())
}

/// The folder `path` is written in (`.` for a bare file name).
pub fn folder_of(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// A temporary file beside `path`, under `temp_prefix` and ending in `path`'s extension (a plot's
/// drawing backend picks the format by it), after removing the stale ones of that name.
pub fn temp_file_for(path: &Path) -> anyhow::Result<tempfile::NamedTempFile> {
    let dir = folder_of(path);
    let name = name_of(path);
    remove_stale_temporaries(dir, &name);
    let suffix = path
        .extension()
        .map_or(String::new(), |e| format!(".{}", e.to_string_lossy()));
    tempfile::Builder::new()
        .prefix(&temp_prefix(&name))
        .suffix(&suffix)
        .tempfile_in(dir)
        .map_err(failed(dir, "cannot create a temporary file"))
}

/// A temporary directory beside `path`, under `temp_prefix`, after removing the stale ones of that name.
pub fn temp_dir_for(path: &Path) -> anyhow::Result<tempfile::TempDir> {
    let dir = folder_of(path);
    let name = name_of(path);
    remove_stale_temporaries(dir, &name);
    tempfile::Builder::new()
        .prefix(&temp_prefix(&name))
        .tempdir_in(dir)
        .with_context(|| format!("{}: cannot create a temporary directory", dir.display()))
}

/// Removes the temporary files and directories that writes of `name` in `dir` left behind when their
/// process was killed: those under `temp_prefix` whose process id no longer runs. Where the system
/// cannot say whether a process runs (no `/proc`), nothing is removed; a process id reused since is taken
/// as running (the entry stays). Says what it removed on standard error.
pub fn remove_stale_temporaries(dir: &Path, name: &str) {
    let start = format!(".{name}.partial-");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let file_name = e.file_name().to_string_lossy().to_string();
        let Some(pid) = file_name
            .strip_prefix(&start)
            .and_then(|rest| rest.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if process_may_run(pid) {
            continue;
        }
        let path = e.path();
        let removed = if path.is_dir() && !path.is_symlink() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        if removed.is_ok() {
            eprintln!(
                "{}: removed; an interrupted write of {name} left it (its process {pid} is gone)",
                path.display()
            );
        }
    }
}

/// Whether process `pid` may still run: false only where `/proc` lists processes and not this one.
fn process_may_run(pid: u32) -> bool {
    let proc = Path::new("/proc");
    !proc.join("self").exists() || proc.join(pid.to_string()).exists()
}

/// Turns an I/O error on `path` into one sentence: the path, what could not be done and why, in words
/// ([`os_error_text`]).
pub fn failed<'a>(
    path: &'a Path,
    what: &'a str,
) -> impl FnOnce(std::io::Error) -> anyhow::Error + 'a {
    move |e| anyhow::anyhow!("{}: {what} ({})", path.display(), os_error_text(&e))
}

/// An I/O error as words for a message that already names the file: "not found", "permission denied"...,
/// without the "(os error N)" suffix that would repeat what the sentence says.
pub fn os_error_text(e: &std::io::Error) -> String {
    use std::io::ErrorKind;
    match e.kind() {
        ErrorKind::NotFound => "not found".into(),
        ErrorKind::PermissionDenied => "permission denied".into(),
        ErrorKind::IsADirectory => "is a directory".into(),
        ErrorKind::NotADirectory => "a part of the path is not a directory".into(),
        ErrorKind::UnexpectedEof => "ends too early".into(),
        ErrorKind::StorageFull => "no space left on the device".into(),
        _ => {
            let text = e.to_string();
            match text.find(" (os error") {
                Some(i) => text[..i].to_string(),
                None => text,
            }
        }
    }
}

/// A fingerprint of the files `names` of `dir`, in the order given: FNV-1a (64-bit, each product folded by
/// a shift) over each name, length and content (as little-endian 64-bit words), as 16 hex digits. Stable
/// across builds and machines, unlike std's hasher (a model folder's identity, a checkpoint's manifest).
pub fn fingerprint_of(dir: &Path, names: &[String]) -> anyhow::Result<String> {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    // FNV-1a on whole words, with a shift after each product: a product only carries bits upwards, so
    // without it the hash's low bits would never see a word's high bits.
    let mut mix = |word: u64| {
        h ^= word;
        h = h.wrapping_mul(PRIME);
        h ^= h >> 32;
    };
    let mut buf = vec![0u8; 1 << 20];
    for name in names {
        name.bytes().for_each(|b| mix(u64::from(b)));
        let path = dir.join(name);
        let mut file = std::fs::File::open(&path).map_err(failed(&path, "cannot open"))?;
        let mut len = 0u64;
        loop {
            let n = fill(&mut file, &mut buf).map_err(failed(&path, "cannot read"))?;
            if n == 0 {
                break;
            }
            len += n as u64;
            // Whole buffers until the last, so words start at the same offsets however the reads split the
            // file; the last one's short tail is padded with zeros (the length keeps files apart).
            for word in buf[..n].chunks(8) {
                let mut w = [0u8; 8];
                w[..word.len()].copy_from_slice(word);
                mix(u64::from_le_bytes(w));
            }
        }
        mix(len);
    }
    Ok(format!("{h:016x}"))
}

/// Reads into `buf` until it is full or the file ends; how many bytes it holds.
fn fill(file: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `within` sees through `..` and links, and a path that does not exist yet is still placed.
    #[test]
    fn within_resolves_dots_and_links() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        std::fs::create_dir_all(run.join("checkpoints")).unwrap();
        let ckpt = run.join("checkpoints");
        assert!(within(&ckpt.join("step_000001"), &ckpt));
        assert!(within(&tmp.path().join("x/../run/checkpoints/a"), &ckpt));
        assert!(!within(&run.join("model"), &ckpt));
        assert!(!within(&tmp.path().join("run/checkpoints2"), &ckpt));
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink(&ckpt, tmp.path().join("link")).unwrap();
            assert!(within(&tmp.path().join("link/step_000001"), &ckpt));
            // `..` after a link goes to the target's parent: `s/../m` is `checkpoints/m` here.
            std::fs::create_dir_all(ckpt.join("sub")).unwrap();
            std::os::unix::fs::symlink(ckpt.join("sub"), tmp.path().join("s")).unwrap();
            assert!(within(&tmp.path().join("s/../m"), &ckpt));
        }
    }

    /// What a killed write left (a temporary file of a process that is gone, and a temporary directory of
    /// a killed `write_dir_atomic`) is removed by the next write of the same name; the temporaries of a
    /// running process, of another name, and anything else stay.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_write_removes_what_killed_writes_of_its_name_left() {
        let dir = tempfile::tempdir().unwrap();
        // Above Linux's largest process id (2^22), so no process has it.
        let gone = 4_194_305u32;
        let mine = std::process::id();
        let stale_file = dir.path().join(format!(".a.json.partial-{gone}-x1.json"));
        let stale_dir = dir.path().join(format!(".a.json.partial-{gone}-x2"));
        let running = dir.path().join(format!(".a.json.partial-{mine}-x3"));
        let other_name = dir.path().join(format!(".b.json.partial-{gone}-x4"));
        let unrelated = dir.path().join(".a.json.partial-notapid");
        std::fs::write(&stale_file, "half").unwrap();
        std::fs::create_dir(&stale_dir).unwrap();
        std::fs::write(stale_dir.join("tensors"), "half").unwrap();
        std::fs::write(&running, "writing").unwrap();
        std::fs::write(&other_name, "half").unwrap();
        std::fs::write(&unrelated, "x").unwrap();
        write_json_atomic(&dir.path().join("a.json"), &1).unwrap();
        assert!(!stale_file.exists() && !stale_dir.exists());
        assert!(running.exists() && other_name.exists() && unrelated.exists());
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .collect();
        names.sort();
        assert_eq!(names.len(), 4, "{names:?}");
        assert!(names.contains(&"a.json".to_string()));
    }

    /// A directory written through `write_dir_atomic` whose filling fails leaves neither the output nor a
    /// temporary directory; one that succeeds leaves only the output.
    #[test]
    fn write_dir_atomic_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("model");
        let failed = write_dir_atomic(&out, |tmp| -> anyhow::Result<()> {
            std::fs::write(tmp.join("config.json"), "{}")?;
            anyhow::bail!("stopped")
        });
        assert!(failed.is_err() && !out.exists());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        write_dir_atomic(&out, |tmp| {
            Ok(std::fs::write(tmp.join("config.json"), "{}")?)
        })
        .unwrap();
        assert!(out.join("config.json").is_file());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    /// Repeated keys are found at any depth and named by their path; a document without one, and
    /// different objects sharing a key, have none.
    #[test]
    fn repeated_keys_are_found_at_any_depth() {
        for (json, want) in [
            (r#"{"seed": 3, "seed": 4}"#, Some("seed")),
            (
                r#"{"train": {"lr": 1, "steps": 2, "lr": 3}}"#,
                Some("train.lr"),
            ),
            (r#"{"a": [{"x": 1}, {"y": 1, "y": 2}]}"#, Some("a.[1].y")),
            (
                r#"{"a": {"x": 1}, "b": {"x": 1}, "c": [1, "s", null, true]}"#,
                None,
            ),
        ] {
            let got = super::first_repeated_key(json.as_bytes()).unwrap();
            assert_eq!(got.as_deref(), want, "{json}");
        }
        assert!(super::first_repeated_key(b"{not json").is_err());
    }

    /// A name given twice is refused before anything is written (the safetensors crate indexed out of
    /// bounds on it), and an earlier file at the path stays as it was.
    #[test]
    fn write_safetensors_refuses_a_repeated_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        std::fs::write(&path, b"before").unwrap();
        let bytes = [0u8; 4];
        let t = |name: &str| {
            (
                name.to_string(),
                safetensors::Dtype::F32,
                vec![1],
                &bytes[..],
            )
        };
        let err = write_safetensors(&path, &[t("a"), t("b"), t("a")]).unwrap_err();
        assert!(
            err.to_string().contains("tensor `a` would be in it twice"),
            "{err}"
        );
        assert_eq!(std::fs::read(&path).unwrap(), b"before");
        write_safetensors(&path, &[t("a"), t("b")]).unwrap();
    }

    /// A device, pipe or socket at an output path is refused before any work and by the writers, and stays
    /// what it was (results were renamed over it: `--output /dev/null` as root replaced the device).
    #[cfg(unix)]
    #[test]
    fn outputs_refuse_special_files() {
        use std::os::unix::fs::FileTypeExt;
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("out.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let err = check_output_file(&socket).unwrap_err().to_string();
        assert!(err.contains("not a regular file"), "{err}");
        let err = write_atomic(&socket, b"results").unwrap_err().to_string();
        assert!(err.contains("not a regular file"), "{err}");
        let err = write_safetensors(&socket, &[]).unwrap_err().to_string();
        assert!(err.contains("not a regular file"), "{err}");
        let kind = std::fs::symlink_metadata(&socket).unwrap().file_type();
        assert!(kind.is_socket(), "the socket was replaced");
        #[cfg(target_os = "linux")]
        {
            let err = check_output_file(Path::new("/dev/null"))
                .unwrap_err()
                .to_string();
            assert!(err.contains("not a regular file"), "{err}");
        }
        // A regular file and a path to be created are fine.
        let file = dir.path().join("out.json");
        check_output_file(&file).unwrap();
        std::fs::write(&file, b"{}").unwrap();
        check_output_file(&file).unwrap();
        check_output_file(&dir.path().join("new/sub/out.json")).unwrap();
    }

    /// A folder no file can be created in is refused before any work, naming the folder (`/proc` refuses
    /// new files even to root, where permission bits would not).
    #[cfg(target_os = "linux")]
    #[test]
    fn outputs_in_a_folder_without_room_for_files_are_refused_first() {
        let err = check_output_file(Path::new("/proc/qarl-output.json"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("no file can be created in /proc"), "{err}");
        let err = check_output_file(Path::new("/proc/qarl-missing/sub/out.json"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("no file can be created in /proc"), "{err}");
    }
}
