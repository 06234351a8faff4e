//! Sandboxes on OCI image roots (issue 21): `launch --image` boots a real Debian image (`scripts/test-image`:
//! mmdebstrap, umoci) from an OCI layout, from a real registry (`docker-registry`, pushed by skopeo) and from
//! a `docker save` archive (made by skopeo), and runs the image's own programs in the microVM: its Python,
//! under its `Env`, `WorkingDir` and `Cmd`, as the fixed sandbox user, on a writable layer of its own.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use vm_test_support::registry::{run, Registry};
use vm_test_support::serve::Serve;
use vm_test_support::test_image::{layout_ref, shared_store};
use vm_test_support::{Launch, Running, Scratch};

/// `launch --image REF` with the store `store`, then `cmd`.
fn launch_image<'a>(s: &'a Scratch, store: &Path, reference: &str, cmd: &[&str]) -> Launch<'a> {
    Launch::new(s, cmd).root_image(reference, store)
}

#[test]
fn an_oci_layout_boots_as_the_root_with_the_images_cmd_env_and_workdir() {
    let s = Scratch::with_deadline("img-root", Duration::from_secs(600));
    let store = shared_store();
    // No command: the image's own (`python3 -c 'print("hello from the image")'`).
    let text = launch_image(&s, store, &layout_ref(), &[]).run().succeeded();
    assert_eq!(text, "hello from the image\n");

    let script = "python3 -c 'import sys; print(sys.version_info[0])'; echo \"$IMAGE_GREETING $OWN\"; pwd; \
                  id -un; id -u; echo \"$HOME\"; getent passwd sandbox | cut -d: -f6; \
                  echo kept > \"$HOME/note\"; cat \"$HOME/note\"; grep -c ' / overlay ' /proc/mounts";
    let t = Scratch::with_deadline("img-root2", Duration::from_secs(300));
    let out = launch_image(&t, store, &layout_ref(), &["/bin/sh", "-c", script]).flag("-e").flag("OWN=mine").run();
    let lines: Vec<String> = out.succeeded().lines().map(str::to_owned).collect();
    assert_eq!(
        lines,
        ["3", "from-the-image mine", "/srv", "sandbox", "1000", "/home/sandbox", "/home/sandbox", "kept", "1"],
        "the image's Python, Env and WorkingDir; the sandbox user with an account and a home; an overlay root"
    );

    // The request's variables and directory win over the image's.
    let u = Scratch::with_deadline("img-root3", Duration::from_secs(300));
    let out = launch_image(&u, store, &layout_ref(), &["/bin/sh", "-c", "echo $IMAGE_GREETING; pwd"])
        .flag("-e")
        .flag("IMAGE_GREETING=from-the-request")
        .flag("-w")
        .flag("/tmp")
        .run();
    assert_eq!(out.succeeded(), "from-the-request\n/tmp\n");

    // What stayed on the host: the sandbox's own writable layer, sparse; the image's disk untouched.
    let disk = t.only_sandbox().join("disk.ext4");
    let meta = std::fs::metadata(&disk).unwrap();
    assert_eq!(meta.len(), u64::from(vm_contract::root::DEFAULT_DISK_MIB) << 20);
    let used = meta.blocks() * 512;
    assert!(used < 8 << 20, "a sandbox that wrote a note uses {used} bytes of its writable layer");
    eprintln!("e2e: writable layer after writing a note: {} KiB allocated of {} MiB", used >> 10, meta.len() >> 20);
}

#[test]
fn two_sandboxes_of_one_image_do_not_see_each_others_writes() {
    let store = shared_store();
    let script =
        |me: &str| format!("echo {me} > \"$HOME/who\"; sleep 3; cat \"$HOME/who\"; ls \"$HOME\" | tr '\\n' ' '; echo");
    let (a, b) = (Scratch::with_deadline("img-iso-a", Duration::from_secs(300)), Scratch::new("img-iso-b"));
    let (sa, sb) = (script("alpha"), script("beta"));
    let (out_a, out_b) = std::thread::scope(|scope| {
        let first = scope.spawn(|| launch_image(&a, store, &layout_ref(), &["/bin/sh", "-c", &sa]).run());
        let second = scope.spawn(|| launch_image(&b, store, &layout_ref(), &["/bin/sh", "-c", &sb]).run());
        (first.join().unwrap(), second.join().unwrap())
    });
    assert_eq!(out_a.succeeded(), "alpha\nwho \n", "each sandbox reads back only its own write");
    assert_eq!(out_b.succeeded(), "beta\nwho \n");
    let (da, db) = (a.only_sandbox().join("disk.ext4"), b.only_sandbox().join("disk.ext4"));
    assert_ne!(std::fs::metadata(&da).unwrap().ino(), std::fs::metadata(&db).unwrap().ino());
    eprintln!("e2e: two concurrent sandboxes of one image, each with its own writable layer");
}

#[test]
fn a_registry_image_and_a_docker_archive_boot_alike() {
    let s = Scratch::with_deadline("img-sources", Duration::from_secs(900));
    let registry = Registry::start(&s.dir.join("registry"), None);
    let reference = registry.push(&layout_ref(), "e2e/py:1");
    let archive = s.dir.join("py.tar");
    run(Command::new("skopeo")
        .arg("copy")
        .arg("--quiet")
        .arg(layout_ref())
        .arg(format!("docker-archive:{}:e2e/py:1", archive.display())));
    let program = ["python3", "-c", "import os; print(6 * 7, os.environ['IMAGE_GREETING'], os.getcwd())"];
    for (name, source) in
        [("registry", reference.clone()), ("archive", format!("docker-archive:{}", archive.display()))]
    {
        let t = Scratch::with_deadline(&format!("img-{name}"), Duration::from_secs(600));
        // A store of its own: the whole path, download and disk build included, on first use.
        let store = t.dir.join("store");
        let started = Instant::now();
        let out = launch_image(&t, &store, &source, &program)
            .flag("--registry-ca")
            .flag(&registry.ca.display().to_string())
            .run();
        assert_eq!(out.succeeded(), "42 from-the-image /srv\n", "{name}");
        eprintln!(
            "e2e: launch --image from the {name}, first use (pull + disk): {:.1} s",
            started.elapsed().as_secs_f64()
        );
        // Cached now: the next launch asks nothing of the source.
        let u = Scratch::new(&format!("img-{name}-again"));
        let out = launch_image(&u, &store, &source, &program).run();
        assert_eq!(out.succeeded(), "42 from-the-image /srv\n", "{name}, cached");
    }
}

#[test]
fn the_writable_layer_is_bounded_by_its_disk_size() {
    let s = Scratch::with_deadline("img-full", Duration::from_secs(300));
    let script = "dd if=/dev/zero of=\"$HOME/big\" bs=1M count=64 2>&1 | grep -o 'No space left on device' | head -1; \
                  echo alive";
    let out =
        launch_image(&s, shared_store(), &layout_ref(), &["/bin/sh", "-c", script]).flag("--disk").flag("32").run();
    assert_eq!(
        out.succeeded(),
        "No space left on device\nalive\n",
        "a full writable layer is the workload's error only"
    );
    let disk = std::fs::metadata(s.only_sandbox().join("disk.ext4")).unwrap();
    assert_eq!(disk.len(), 32 << 20, "the host file never grows past the size asked for");
    assert!(disk.blocks() * 512 <= 32 << 20);
}

#[test]
fn a_missing_image_fails_fast_and_makes_no_sandbox() {
    let s = Scratch::new("img-missing");
    let started = Instant::now();
    let missing = format!("oci:{}:py", s.dir.join("nowhere").display());
    let out = launch_image(&s, &s.dir.join("store"), &missing, &["true"]).run();
    assert_ne!(out.code, Some(0));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cannot get the image"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
    let sandboxes = s.state().join("sandboxes");
    assert!(!sandboxes.exists() || std::fs::read_dir(&sandboxes).unwrap().next().is_none(), "no sandbox was made");
    out.assert_nothing_left();
}

#[test]
fn serve_creates_from_a_reference_with_the_pull_on_watch_and_keeps_the_image_while_it_is_used() {
    use tokio_stream::StreamExt;
    use vm_protocol::driver_api::{
        pull_image_progress, watch_event, CreateSandboxRequest, ListImagesRequest, PullImageRequest,
        RemoveImageRequest, SandboxSpec, SandboxState, WatchRequest,
    };
    let s = Scratch::with_deadline("img-serve", Duration::from_secs(900));
    let registry = Registry::start(&s.dir.join("registry"), None);
    let reference = registry.push(&layout_ref(), "e2e/py:1");
    let store = s.dir.join("store");
    let (store_arg, ca_arg) = (store.display().to_string(), registry.ca.display().to_string());
    let mut serve = Serve::with(&s, &[], &["--image-cache", &store_arg, "--registry-ca", &ca_arg]);
    let (rt, mut client) = serve.grpc();
    let spec = |image: &str| SandboxSpec { image: image.into(), disk_mib: 256, ..SandboxSpec::default() };

    // A create pulls on first use, with its progress on Watch, and the sandbox becomes ready on the image.
    let (pull_notes, ready) = rt.block_on(async {
        let request = WatchRequest { sandbox_id: "py".into() };
        let mut watch = client.watch(request).await.unwrap().into_inner();
        let create =
            CreateSandboxRequest { sandbox_id: "py".into(), spec: Some(spec(&reference)), credentials: Vec::new() };
        client.create_sandbox(create).await.unwrap();
        let mut notes = Vec::new();
        while let Some(event) = watch.next().await {
            match event.unwrap().event {
                Some(watch_event::Event::Platform(p)) if p.kind == "pulling-image" => notes.push(p.message),
                Some(watch_event::Event::Changed(sb)) if sb.state == SandboxState::Ready as i32 => {
                    return (notes, true)
                }
                Some(watch_event::Event::Changed(sb)) if sb.state == SandboxState::Failed as i32 => {
                    panic!("failed: {}", sb.detail)
                }
                _ => {}
            }
        }
        (notes, false)
    });
    assert!(ready);
    assert!(pull_notes.first().is_some_and(|n| n.starts_with("pulling image ")), "{pull_notes:?}");
    assert!(pull_notes.iter().any(|n| n.starts_with("layer 1/1 sha256:") && n.ends_with(" bytes")), "{pull_notes:?}");
    assert!(
        pull_notes.last().is_some_and(|n| n.starts_with("image sha256:") && n.ends_with(" ready")),
        "{pull_notes:?}"
    );
    let exec = serve.cli("exec", &["py", "--", "python3", "-c", "import os; print(6 * 7, os.getcwd())"]);
    assert_eq!(String::from_utf8_lossy(&exec.stdout), "42 /srv\n", "{}", String::from_utf8_lossy(&exec.stderr));
    eprintln!("e2e: serve: created from {reference}, {} pull notes on Watch", pull_notes.len());

    // A start after a stop keeps its writable layer.
    assert!(serve.cli("exec", &["py", "--", "sh", "-c", "echo kept > $HOME/note"]).status.success());
    assert!(serve.cli("stop", &["py"]).status.success());
    assert!(serve.cli("start", &["py"]).status.success());
    serve.wait_ready("py");
    let note = serve.cli("exec", &["py", "--", "cat", "/home/sandbox/note"]);
    assert_eq!(String::from_utf8_lossy(&note.stdout), "kept\n", "the writable layer outlives a stop");
    // And a driver that crashed: its VMs die with it, the restarted driver boots the sandbox on the same layer.
    serve.kill();
    serve.restart();
    // Restored after the driver's restart.
    serve.wait_state("py", "ready", Duration::from_secs(180));
    let note = serve.cli("exec", &["py", "--", "cat", "/home/sandbox/note"]);
    assert_eq!(String::from_utf8_lossy(&note.stdout), "kept\n", "the writable layer outlives a driver restart");
    let (rt, mut client) = serve.grpc();

    // In use: listed so, and neither the API nor the CLI removes it.
    let images = rt.block_on(client.list_images(ListImagesRequest {})).unwrap().into_inner().images;
    assert_eq!(images.len(), 1);
    assert!(images[0].in_use && images[0].names.contains(&reference), "{images:?}");
    let refused = rt.block_on(client.remove_image(RemoveImageRequest { reference: reference.clone() })).unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused:?}");
    let cli = Command::new(&vm_test_support::harness().shipped.driver)
        .args(["image", "--image-cache", &store_arg, "rm", &reference, "--state-dir"])
        .arg(&serve.state)
        .output()
        .unwrap();
    assert!(!cli.status.success() && String::from_utf8_lossy(&cli.stderr).contains("in use"), "{cli:?}");

    // A pull that cannot succeed is a FAILED sandbox naming the cause; the store is unchanged.
    let missing = format!("{}/e2e/missing:1", registry.addr);
    let failed = rt.block_on(async {
        client
            .create_sandbox(CreateSandboxRequest {
                sandbox_id: "bad".into(),
                spec: Some(spec(&missing)),
                credentials: Vec::new(),
            })
            .await
            .unwrap();
        let mut watch = client.watch(WatchRequest { sandbox_id: "bad".into() }).await.unwrap().into_inner();
        while let Some(event) = watch.next().await {
            if let Some(watch_event::Event::Changed(sb)) = event.unwrap().event {
                if sb.state == SandboxState::Failed as i32 {
                    return sb.detail;
                }
            }
        }
        String::new()
    });
    assert!(failed.contains("cannot get the image") && failed.contains("e2e/missing"), "{failed}");
    let again = rt.block_on(client.list_images(ListImagesRequest {})).unwrap().into_inner().images;
    assert_eq!(again.len(), 1, "the failed pull left nothing in the store");

    // PullImage streams progress, then the image; once no sandbox uses it, it is removed.
    let (layers, last) = rt.block_on(async {
        let mut stream =
            client.pull_image(PullImageRequest { reference: reference.clone() }).await.unwrap().into_inner();
        let (mut layers, mut last) = (0, None);
        while let Some(message) = stream.next().await {
            match message.unwrap().progress {
                Some(pull_image_progress::Progress::Layer(_)) => layers += 1,
                Some(pull_image_progress::Progress::Image(info)) => last = Some(info),
                None => {}
            }
        }
        (layers, last)
    });
    assert!(layers >= 1 && last.is_some_and(|i| i.manifest == images[0].manifest), "{layers} layer messages");
    assert!(serve.cli("rm", &["py"]).status.success());
    let removed = rt.block_on(client.remove_image(RemoveImageRequest { reference: reference.clone() })).unwrap();
    assert_eq!(removed.into_inner().manifest, images[0].manifest);
    assert!(rt.block_on(client.list_images(ListImagesRequest {})).unwrap().into_inner().images.is_empty());
}

/// `--image-cache-max`: past the cap the least recently used image goes, unless a sandbox uses it. The
/// control is the same store and cap once the sandbox has ended.
#[test]
fn the_cache_cap_evicts_the_least_recently_used_image_never_one_in_use() {
    let s = Scratch::with_deadline("img-evict", Duration::from_secs(600));
    let store = s.dir.join("store");
    let image = |args: &[&str]| {
        let out = Command::new(&vm_test_support::harness().shipped.driver)
            .arg("image")
            .arg("--image-cache")
            .arg(&store)
            .arg("--state-dir")
            .arg(s.state())
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    image(&["import", &layout_ref()]);
    let small = vm_test_support::registry::umoci_image(
        &s.dir,
        "small",
        &[&|root: &Path| {
            std::fs::write(root.join("note"), "small\n").unwrap();
        }],
        &[],
    );
    let small_ref = format!("oci:{}:small", small.display());

    // The Debian image in use by a running sandbox survives a cap of one byte.
    let launch = launch_image(&s, &store, &layout_ref(), &["/bin/sh", "-c", "echo up; exec sleep 600"]);
    let mut running = Running::start(launch, &[], "up");
    image(&["import", "--image-cache-max", "1", &small_ref]);
    let listed = image(&["ls"]);
    assert!(listed.contains(&layout_ref()) && listed.contains(&small_ref), "both kept: {listed}");
    assert!(listed.lines().any(|l| l.contains(&layout_ref()) && l.contains(" yes ")), "{listed}");

    // Once the sandbox ended, the same cap takes it: it is the least recently used.
    vm_test_support::procs::signal(running.driver_pid(), nix::sys::signal::Signal::SIGTERM);
    let _ = running.driver.wait();
    image(&["import", "--image-cache-max", "1", &small_ref]);
    let listed = image(&["ls"]);
    assert!(!listed.contains(&layout_ref()) && listed.contains(&small_ref), "the unused image went: {listed}");
    drop(running);
}

#[test]
fn a_stop_asks_with_the_images_stop_signal_and_its_user_is_reported_not_obeyed() {
    let s = Scratch::new("img-stop");
    let script = "trap 'echo stopped by INT; exit 0' INT; trap 'echo stopped by TERM; exit 0' TERM; echo up; id -u; \
                  while :; do sleep 0.1; done";
    let launch = launch_image(&s, shared_store(), &layout_ref(), &["/bin/sh", "-c", script]);
    let mut running = Running::start(launch, &[], "up");
    let mut line = String::new();
    std::io::BufRead::read_line(&mut running.stdout, &mut line).unwrap();
    assert_eq!(line, "1000\n", "the image's User (1234) is not obeyed");
    vm_test_support::procs::signal(running.driver_pid(), nix::sys::signal::Signal::SIGTERM);
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut running.stdout, &mut rest).unwrap();
    let _ = running.driver.wait();
    assert_eq!(rest, "stopped by INT\n", "the image's StopSignal (SIGINT), not SIGTERM");
    let stderr = running.stderr_text();
    assert!(stderr.contains("the image asks for user \"1234\""), "{stderr}");
}

/// `serve --pool COUNT:CPUS:MIB:IMAGE`: pooled VMs boot the image root ahead of demand, and a create of that
/// image claims one; restored from a snapshot (`--pool-snapshots`), each VM boots on its own copy of the
/// saved writable layer, so one sandbox's writes never reach the next.
#[test]
fn a_pool_of_an_image_root_serves_creates_of_that_image_booted_and_restored() {
    use vm_protocol::driver_api::{ListPoolRequest, SandboxSpec};
    use vm_test_support::api::create_ready;
    let store = shared_store().display().to_string();
    let target = format!("1:1:256:{}", layout_ref());
    for (kind, extra) in [("booted", None), ("restored", Some("--pool-snapshots"))] {
        let t = Scratch::with_deadline(&format!("img-pool-{kind}"), Duration::from_secs(600));
        let mut args = vec!["--image-cache", &store, "--pool", &target];
        args.extend(extra);
        let serve = Serve::with(&t, &[], &args);
        let (rt, mut client) = serve.grpc();
        let mut create = |id: &str| {
            rt.block_on(async {
                let full = async {
                    loop {
                        let vms = client.list_pool(ListPoolRequest {}).await.unwrap().into_inner().vms;
                        if vms.iter().any(|v| v.state == "ready") {
                            return vms;
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                };
                let vms = tokio::time::timeout(Duration::from_secs(300), full).await.expect("the pool filled");
                assert!(vms.iter().all(|v| v.image == layout_ref()), "{vms:?}");
                let spec = SandboxSpec { image: layout_ref(), ..SandboxSpec::default() };
                create_ready(&mut client, id, Some(spec)).await.1.origin
            })
        };
        assert_eq!(create("first"), "pool", "{kind}: a create of the pool's image claims a pooled VM");
        let out =
            serve.cli("exec", &["first", "--", "sh", "-c", "python3 -c 'print(6 * 7)'; echo mine > $HOME/a; ls $HOME"]);
        assert_eq!(String::from_utf8_lossy(&out.stdout), "42\na\n", "{kind}: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(create("second"), "pool", "{kind}: the refilled pool serves the next");
        let out = serve.cli("exec", &["second", "--", "sh", "-c", "ls -A $HOME; echo end"]);
        assert_eq!(String::from_utf8_lossy(&out.stdout), "end\n", "{kind}: the first sandbox's write is not here");
        eprintln!("e2e: a pool of the image root ({kind}): two creates claimed, writes kept apart");
    }
}
