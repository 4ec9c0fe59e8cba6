/* Boot: PVH start info, markers, devices; then the main loop every interrupt restarts. */
#include "cmdline.h"
#include "disk.h"
#include "handlers.h"
#include "pic.h"
#include "plat.h"
#include "virtio.h"
#include "vsock.h"
#include "x86.h"

#define START_INFO_MAGIC 0x336ec578u
#define DIRTY_BASE 0x1000000u
#define E820_RAM 1

u32 mp_count_cpus(void);
void clock_init(void);
TG_NORETURN void tg_start(u32 start_info);
TG_NORETURN void tg_main_loop(void);
TG_NORETURN void tg_irq(u32 vector);

static u32 dev_irq = ~0u;
static u32 irqtest_left;

/* testguest.irqtest: a few PIT ticks on IRQ 0 prove the PIC/LAPIC wiring and the restart
 * path (each tick re-enters the main loop from scratch) without any virtio device. */
#define IRQTEST_TICKS 5
static void irqtest_start(void)
{
	u32 latch = 1193182u / 1000; /* 1 ms */
	irqtest_left = IRQTEST_TICKS;
	outb(0x43, 0x34); /* channel 0, lobyte/hibyte, mode 2 (rate generator) */
	outb(0x40, (u8)latch);
	outb(0x40, (u8)(latch >> 8));
	pic_unmask(0);
}

static void irqtest_tick(void)
{
	if (!irqtest_left || --irqtest_left)
		return;
	pic_mask(0);
	outb(0x43, 0x30); /* channel 0 back to mode 0, left without a count: no more ticks */
	/* Also exercises the TSC calibration HealthReport uses. */
	struct tg_line l = {.len = 0};
	line_str(&l, "TESTGUEST IRQTEST OK uptime_ms=");
	line_u64(&l, plat_uptime_ms());
	line_emit(&l);
}

/* The dirty region runs from 16 MiB to the end of the RAM entry holding it. */
static void setup_dirty_region(const u8 *si)
{
	u64 map = ld64(si + 40);
	u32 entries = TG_MIN(ld32(si + 48), 128u);
	u32 pages = 0;
	if (ld32(si + 4) < 1 || map >> 32)
		entries = 0; /* version 0 has no memory map */
	for (u32 i = 0; i < entries; i++) {
		const u8 *e = (const u8 *)(uintptr_t)map + i * 24;
		u64 addr = ld64(e), end = addr + ld64(e + 8);
		if (ld32(e + 16) != E820_RAM || addr > DIRTY_BASE || end <= DIRTY_BASE)
			continue;
		if (end > 0x100000000ull) /* paging is off: only the low 4 GiB are reachable */
			end = 0x100000000ull;
		pages = (u32)((end - DIRTY_BASE) >> 12);
	}
	tg_dirty_setup((u8 *)(uintptr_t)DIRTY_BASE, pages);
}

static void start_vsock(const struct tg_cmdline *cl)
{
	const struct tg_mmio_dev *dev = 0;
	for (u32 i = 0; i < cl->ndev && !dev; i++)
		if (virtio_is_vsock(cl->dev[i].base, cl->dev[i].size))
			dev = &cl->dev[i];
	if (!cl->ndev) {
		tg_log("NOVSOCK no virtio_mmio.device on the command line");
		return;
	}
	if (!dev) {
		tg_log("NOVSOCK no vsock among the virtio_mmio devices");
		return;
	}
	/* 0 is the PIT's and 2 the cascade; the PIC has only 16 lines. */
	if (dev->irq == 0 || dev->irq == 2 || dev->irq > 15) {
		tg_log("NOVSOCK irq unusable with the 8259 PIC");
		return;
	}
	if (virtio_vsock_init(dev->base, dev->size))
		return;
	dev_irq = dev->irq;
	pic_unmask(dev_irq);
	if (cl->connect_port && tg_vsock_connect(cl->connect_port))
		tg_error("connect: no free connection");
}

void tg_start(u32 start_info)
{
	tg_log("BOOT");
	idt_init();
	clock_init();

	const u8 *si = (const u8 *)(uintptr_t)start_info;
	struct tg_cmdline cl;
	tg_cmdline_parse("", 0, &cl);
	if (!start_info || ld32(si) != START_INFO_MAGIC) {
		tg_error("no hvm_start_info");
	} else {
		u64 cmdline = ld64(si + 24);
		if (cmdline && !(cmdline >> 32))
			tg_cmdline_parse((const char *)(uintptr_t)cmdline, 4096, &cl);
		setup_dirty_region(si);
	}

	struct tg_line l = {.len = 0};
	line_str(&l, "TESTGUEST CPUS ");
	line_u64(&l, mp_count_cpus());
	line_emit(&l);

	pic_init();
	lapic_virtual_wire();
	start_vsock(&cl);
	if (cl.disk)
		disk_check(&cl);
	if (cl.irqtest)
		irqtest_start();
	tg_set_echo(cl.echo);
	if (cl.bad)
		tg_error_n("malformed command line options ignored:", cl.bad);
	tg_log("READY");
	tg_main_loop();
}

/*
 * Interrupts are enabled only inside "sti; hlt" (the sti shadow makes checking for work and
 * halting atomic), so an interrupt can only land there and the whole body below may simply be
 * restarted from the top by tg_irq.
 */
void tg_main_loop(void)
{
	for (;;) {
		virtio_service();
		if (!virtio_pending())
			__asm__ volatile("sti; hlt; cli" : : : "memory");
	}
}

/* Entered from start.S on a fresh stack with interrupts disabled. */
void tg_irq(u32 vector)
{
	if (vector >= TG_IRQ_BASE && vector < TG_IRQ_BASE + 16) {
		u32 irq = vector - TG_IRQ_BASE;
		if (pic_ack(irq)) {
			if (irq == dev_irq)
				virtio_irq();
			else if (irq == 0)
				irqtest_tick();
		}
	}
	/* Anything else (the LAPIC's spurious vector) needs no acknowledgement. */
	tg_main_loop();
}

void plat_reset(void)
{
	outb(0x64, 0xfe); /* i8042 pulse reset: the VMM stops the VM */
	halt_forever();
}
