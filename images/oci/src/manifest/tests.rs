use super::*;

fn d(tag: &str) -> String {
    Digest::of(tag.as_bytes()).to_string()
}

fn index(platforms: &[(&str, &str)]) -> String {
    let entries: Vec<String> = platforms
        .iter()
        .map(|(os, arch)| {
            format!(
                r#"{{"mediaType":"{OCI_MANIFEST}","digest":"{}","size":10,"platform":{{"os":"{os}","architecture":"{arch}"}}}}"#,
                d(arch)
            )
        })
        .collect();
    format!(r#"{{"schemaVersion":2,"mediaType":"{OCI_INDEX}","manifests":[{}]}}"#, entries.join(","))
}

fn manifest(config_type: &str, layer_type: &str, layers: usize) -> String {
    let layers: Vec<String> = (0..layers)
        .map(|i| format!(r#"{{"mediaType":"{layer_type}","digest":"{}","size":{i}}}"#, d(&i.to_string())))
        .collect();
    format!(
        r#"{{"schemaVersion":2,"mediaType":"{DOCKER_MANIFEST}","config":{{"mediaType":"{config_type}","digest":"{}","size":5}},"layers":[{}]}}"#,
        d("config"),
        layers.join(",")
    )
}

fn config_json(diff_ids: usize) -> String {
    let ids: Vec<String> = (0..diff_ids).map(|i| format!("\"{}\"", d(&format!("diff{i}")))).collect();
    format!(
        r#"{{"architecture":"amd64","os":"linux","config":{{"Env":["PATH=/usr/bin","LANG=C.UTF-8"],"WorkingDir":"/srv","Entrypoint":["python3"],"Cmd":["-V"],"User":"root","StopSignal":"SIGINT"}},"rootfs":{{"type":"layers","diff_ids":[{}]}}}}"#,
        ids.join(",")
    )
}

#[test]
fn an_index_resolves_to_linux_amd64_only() {
    let Parsed::Index(i) = parse(index(&[("linux", "arm64"), ("linux", "amd64")]).as_bytes(), None).unwrap() else {
        panic!("not an index")
    };
    assert_eq!(digest_of(pick_platform(&i).unwrap()).unwrap().to_string(), d("amd64"));
    let Parsed::Index(i) = parse(index(&[("linux", "arm64"), ("windows", "amd64")]).as_bytes(), None).unwrap() else {
        panic!("not an index")
    };
    let err = pick_platform(&i).unwrap_err().to_string();
    assert!(err.contains("linux/arm64, windows/amd64"), "{err}");
}

#[test]
fn a_docker_manifest_and_its_config_give_the_run_settings_and_layers() {
    let m = manifest(DOCKER_CONFIG, DOCKER_LAYER, 2);
    let Parsed::Image(m) = parse(m.as_bytes(), Some("application/vnd.docker.distribution.manifest.v2+json")).unwrap()
    else {
        panic!("not a manifest")
    };
    let (run, layers) = config(config_json(2).as_bytes(), &m).unwrap();
    assert_eq!(run.env, ["PATH=/usr/bin", "LANG=C.UTF-8"]);
    assert_eq!(
        (run.working_dir.as_deref(), run.user.as_deref(), run.stop_signal.as_deref()),
        (Some("/srv"), Some("root"), Some("SIGINT"))
    );
    assert_eq!((run.entrypoint, run.cmd), (vec!["python3".to_owned()], vec!["-V".to_owned()]));
    assert_eq!(layers.len(), 2);
    assert_eq!(layers[1].compression, Compression::Gzip);
    assert_eq!(layers[1].diff_id.to_string(), d("diff1"));
}

#[test]
fn what_is_not_handled_is_refused_by_name() {
    let schema1 = r#"{"schemaVersion":1,"name":"x","tag":"y","fsLayers":[]}"#;
    assert!(matches!(parse(schema1.as_bytes(), None), Err(ManifestError::Schema1)));
    let odd = r#"{"schemaVersion":2,"mediaType":"application/vnd.example+json"}"#;
    assert!(matches!(parse(odd.as_bytes(), None), Err(ManifestError::MediaType(_))));
    assert!(matches!(parse(b"{not json", None), Err(ManifestError::Malformed { .. })));
    let big = vec![b' '; usize::try_from(MAX_MANIFEST_BYTES).unwrap() + 1];
    assert!(matches!(parse(&big, None), Err(ManifestError::TooLarge { .. })));
    let foreign = manifest(DOCKER_CONFIG, "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip", 1);
    let Parsed::Image(m) = parse(foreign.as_bytes(), None).unwrap() else { panic!() };
    assert!(matches!(config(config_json(1).as_bytes(), &m), Err(ManifestError::MediaType(_))));
    let Parsed::Image(m) = parse(manifest(DOCKER_CONFIG, DOCKER_LAYER, 2).as_bytes(), None).unwrap() else { panic!() };
    assert!(matches!(config(config_json(1).as_bytes(), &m), Err(ManifestError::DiffIds { diff_ids: 1, layers: 2 })));
}

proptest::proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
        if let Ok(Parsed::Image(m)) = parse(&bytes, None) {
            let _ = config(&bytes, &m);
        }
        if let Ok(Parsed::Index(i)) = parse(&bytes, None) {
            let _ = pick_platform(&i);
        }
    }
}
