//! `bind_api_socket`: mode 0600, stale sockets replaced, nothing else touched.

use std::io::ErrorKind;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};

use agentvm_vmm_api::bind_api_socket;

#[tokio::test]
async fn binds_with_mode_0600_and_leaves_nothing_behind() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("api.sock");
    let _listener = bind_api_socket(&path).expect("bind");
    let meta = std::fs::symlink_metadata(&path).expect("stat");
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let entries: Vec<_> = std::fs::read_dir(dir.path())
        .expect("readdir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(entries, vec!["api.sock"], "staging leftovers");
}

#[tokio::test]
async fn refuses_to_replace_a_regular_file_or_directory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("api.sock");
    std::fs::write(&file, b"precious").expect("write");
    let err = bind_api_socket(&file).expect_err("regular file");
    assert_eq!(err.kind(), ErrorKind::AlreadyExists);
    assert!(err.to_string().contains("api.sock"), "{err}");
    assert_eq!(std::fs::read(&file).expect("still there"), b"precious");

    let sub = dir.path().join("sub");
    std::fs::create_dir(&sub).expect("mkdir");
    assert_eq!(
        bind_api_socket(&sub).expect_err("directory").kind(),
        ErrorKind::AlreadyExists
    );
    assert!(sub.is_dir());

    let link = dir.path().join("link.sock");
    std::os::unix::fs::symlink(&file, &link).expect("symlink");
    assert_eq!(
        bind_api_socket(&link).expect_err("symlink").kind(),
        ErrorKind::AlreadyExists
    );
}

#[tokio::test]
async fn replaces_a_stale_socket_but_not_a_live_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("api.sock");
    drop(std::os::unix::net::UnixListener::bind(&path).expect("stale bind"));
    assert!(path.exists(), "a dropped listener leaves its file");
    let live = bind_api_socket(&path).expect("stale socket replaced");

    let err = bind_api_socket(&path).expect_err("live socket");
    assert_eq!(err.kind(), ErrorKind::AddrInUse);
    drop(live);
}

#[test]
fn outside_a_runtime_is_an_error_not_a_panic() {
    let dir = tempfile::tempdir().expect("tempdir");
    let err = bind_api_socket(dir.path().join("api.sock")).expect_err("no runtime");
    assert!(err.to_string().contains("tokio runtime"), "{err}");
}
