//! TOML files read into typed settings, naming the key of a value that does not fit.

/// `text` as a `T`; on failure the dotted key (`.` for the whole file) and what is wrong.
pub fn parse<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, (String, String)> {
    serde_path_to_error::deserialize(toml::Deserializer::new(text)).map_err(|e| {
        let key = e.path().to_string();
        (key, e.into_inner().message().to_owned())
    })
}

/// Writes `text` to a temporary file `name` and loads it with `load` (tests of file loaders).
#[cfg(test)]
pub fn load_written<T>(name: &str, text: &str, load: impl FnOnce(&std::path::Path) -> T) -> T {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(name);
    std::fs::write(&path, text).unwrap();
    load(&path)
}
